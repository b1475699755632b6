import subprocess
import sys

CODE = """
import sys
sys.modules['torch'] = None  # as if torch were not installed
import packtool
try:
    import packtool.loader
except ImportError as err:
    print(err)
"""


def test_packtool_imports_without_torch_and_loader_names_the_install():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True).stdout
    assert "pip install 'packtool[loader]'" in out and "pip install torch==2.13.0" in out
