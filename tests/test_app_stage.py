"""The staged app: the files Flower's FAB holds, found without walking what .gitignore excludes."""

from __future__ import annotations

from pathlib import Path

from fedfm_flower.simulation.app_stage import app_files, fab_paths, stage_app


def _app(root: Path, gitignore: str) -> Path:
    for relative in ("pyproject.toml", "pkg/app.py", "runs/r1/out.py", ".git/hooks/h.py"):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text("")
    (root / "pyproject.toml").write_text('[project]\nname = "demo"\n')
    (root / ".gitignore").write_text(gitignore)
    (root / "linked.py").symlink_to(root / "pkg" / "app.py")
    return root


def test_ignored_directories_git_and_symlinks_are_not_walked(tmp_path: Path) -> None:
    app = _app(tmp_path / "app", "runs/\n")
    assert set(app_files(app)) == {"pyproject.toml", "pkg/app.py", ".gitignore"}
    assert fab_paths(app) == ["pkg/app.py"]
    stage = stage_app(app, tmp_path / "stage")
    assert sorted(p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file()) == [
        "pkg/app.py",
        "pyproject.toml",
    ]


def test_a_negated_pattern_turns_pruning_off_and_leaves_the_choice_to_flower(
    tmp_path: Path,
) -> None:
    app = _app(tmp_path / "app", "runs/*\n!runs/r1/\n")
    assert "runs/r1/out.py" in app_files(app)
    assert fab_paths(app) == ["pkg/app.py", "runs/r1/out.py"]
