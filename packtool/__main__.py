from packtool.cli import run

run()
