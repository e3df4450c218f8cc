"""A type checker sees batchgen's public names (the package loads them lazily at runtime, and
declares them under TYPE_CHECKING for tools), and the package ships its py.typed marker."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import batchgen

pytest.importorskip("mypy")

USER_SCRIPT = '''
import batchgen
from batchgen import Engine, SamplingParams

params = SamplingParams(max_tokens=8, temperature=0.0)
engine_cls = batchgen.Engine
reveal_type(engine_cls)
reveal_type(batchgen.generate)
reveal_type(batchgen.connect)
reveal_type(params)
def use(engine: Engine) -> None:
    reveal_type(engine.generate)
'''


def test_mypy_resolves_the_public_names(tmp_path: Path) -> None:
    script = tmp_path / "user_job.py"
    script.write_text(USER_SCRIPT)
    # heavy third-party packages are not followed: only batchgen's own names must resolve
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\nfollow_imports = silent\nignore_missing_imports = True\n"
                      "[mypy-torch.*,transformers.*,diffusers.*,distributed.*,dask.*,pandas.*,pyarrow.*,"
                      "numpy.*,scipy.*,triton.*,tokenizers.*,safetensors.*,llguidance.*]\nfollow_imports = skip\n")
    # the checkout on mypy's path: an editable install's import hook is invisible to mypy
    root = Path(batchgen.__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(config), "--no-incremental",
                           "--cache-dir", str(tmp_path / "cache"), str(script)],
                          capture_output=True, text=True, timeout=540, cwd=tmp_path,
                          env={**os.environ, "MYPYPATH": str(root)})
    out = done.stdout
    revealed = [line for line in out.splitlines() if "Revealed type" in line]
    assert len(revealed) == 5, out
    assert revealed[0].endswith('-> batchgen.engine.facade.Engine"'), out
    assert "def (pdf:" in revealed[1] and "messages_column: str | None" in revealed[1], out
    assert "def (scheduler_address:" in revealed[2], out
    assert revealed[3].endswith('"batchgen.sampling_params.SamplingParams"'), out
    assert "list[batchgen.outputs.RequestOutput]" in revealed[4], out


def test_the_package_ships_its_type_marker() -> None:
    assert (Path(batchgen.__file__).parent / "py.typed").is_file()
