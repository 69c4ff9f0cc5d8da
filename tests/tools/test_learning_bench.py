"""The learning benchmark's run folders (benchmarks/learning.py): a folder holds one recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.learning import LR, LR_BEFORE_RECORDED, check_recipe


def test_a_folder_takes_its_own_recipe_again_and_refuses_another(tmp_path: Path) -> None:
    recipe = {"steps": 300, "heads": 4, "lr": LR}
    check_recipe(tmp_path, recipe)
    assert json.loads((tmp_path / "recipe.json").read_text()) == recipe
    check_recipe(tmp_path, dict(recipe))  # the same recipe goes on from the runs there
    with pytest.raises(SystemExit, match="another recipe"):
        check_recipe(tmp_path, {**recipe, "lr": LR / 2})
    assert json.loads((tmp_path / "recipe.json").read_text()) == recipe  # left as it was


def test_a_folder_from_before_the_lr_was_recorded_ran_at_the_old_default(tmp_path: Path) -> None:
    (tmp_path / "recipe.json").write_text(json.dumps({"steps": 300, "heads": 4}))
    check_recipe(tmp_path, {"steps": 300, "heads": 4, "lr": LR_BEFORE_RECORDED})
    assert LR != LR_BEFORE_RECORDED
    with pytest.raises(SystemExit, match="another recipe"):
        check_recipe(tmp_path, {"steps": 300, "heads": 4, "lr": LR})
