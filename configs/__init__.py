"""Build configs shipped with packtool (package data)."""
