"""The quick loop's selection (`./test.sh -m quick`): conftest.py marks `quick` every test that carries none of
the other markers pyproject.toml declares."""
import tomllib
from pathlib import Path

import conftest


def test_every_declared_marker_but_quick_keeps_a_test_out_of_the_quick_loop():
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    declared = {line.split(":")[0] for line in pyproject["tool"]["pytest"]["ini_options"]["markers"]}
    assert "quick" in declared
    assert declared - {"quick"} == set(conftest.NOT_QUICK), "declare each marker in pyproject.toml and NOT_QUICK"


def test_a_test_without_markers_is_quick(request):
    assert request.node.get_closest_marker("quick") is not None
    assert not any(request.node.get_closest_marker(name) for name in conftest.NOT_QUICK)
