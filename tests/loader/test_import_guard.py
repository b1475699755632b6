import subprocess
import sys

import pytest

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


MISSING_CLI = """
import sys
sys.modules[sys.argv[1]] = None  # as if it were not installed
from click.testing import CliRunner
from packtool.cli import main
result = CliRunner().invoke(main, sys.argv[2:])
print(result.exit_code, result.output.strip())
"""


@pytest.mark.parametrize(
    "missing, args, expected",
    [
        ("torch", ["trace", "{tmp}", "--step", "0"], "1 Error: packtool trace needs the loader"),
        # the probe needs both: one line naming the extra that brings both, whichever is missing
        (
            "torch",
            ["audit", "--probe", "llama"],
            "1 Error: packtool audit --probe needs PyTorch and transformers: pip install 'packtool[hf]'",
        ),
        (
            "transformers",
            ["audit", "--probe", "llama"],
            "1 Error: packtool audit --probe needs PyTorch and transformers: pip install 'packtool[hf]'",
        ),
    ],
)
def test_torch_commands_without_their_extra_are_one_line_naming_the_install(tmp_path, missing, args, expected):
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    out = subprocess.run(
        [sys.executable, "-c", MISSING_CLI, missing, *args], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith(expected) and "pip install 'packtool[" in out.stdout
    assert "Traceback" not in out.stdout


FRONT_DOOR = """
import sys
import packtool.loader
print(len(packtool.loader.__all__), 'transformers' in sys.modules)
"""


def test_the_front_door_is_small_and_hf_is_imported_on_first_use():
    import packtool.loader

    assert set(packtool.loader.__all__) == {
        "DatasetError",
        "LoadedPack",
        "MicroBatch",
        "PackedDataset",
        "chunked_token_loss_sum",
        "collate",
        "context_parallel_slice",
        "hf",
        "packed_batches",
        "packed_steps",
        "token_loss_sum",
        "varlen_attention",
        "window_metrics",
        "window_norm",
    }
    assert all(getattr(packtool.loader, name) is not None for name in packtool.loader.__all__)
    lines = subprocess.run([sys.executable, "-c", FRONT_DOOR], capture_output=True, text=True, check=True).stdout
    assert lines.splitlines()[0] == "14 False"  # importing the loader does not pull in transformers


READ_AN_EPOCH = """
import sys
from packtool.loader import PackedDataset, packed_batches
tokens = sum(mb.n_tokens for mb in packed_batches(PackedDataset(sys.argv[1], token_budget=4096)))
print(tokens, 'pandas' in sys.modules)
"""


def test_reading_an_epoch_does_not_import_pandas(quickstart_build):
    """pyarrow's to_numpy imports pandas (0.3-1 s per process and DataLoader worker); the loader reads
    its columns as buffer views instead."""
    out = subprocess.run(
        [sys.executable, "-c", READ_AN_EPOCH, str(quickstart_build)], capture_output=True, text=True, check=True
    ).stdout.split()
    assert int(out[0]) > 0 and out[1] == "False"
