"""service/common/catalogue.py: what a promote by name means."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.common.catalogue import resolve_by_name
from service.common.errors import InvalidValue, NotFound
from service.common.settings import Settings


def test_a_promote_by_name_is_a_directory_under_models_root_or_a_shipped_model(
    tmp_path: Path,
) -> None:
    """A symbolic link under models_root leading out of it is refused saying so (it answered
    "no model 'linked' under models_root", which it was); a name that is nothing is a 404."""
    root = tmp_path / "models"
    (root / "mine").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "linked").symlink_to(elsewhere, target_is_directory=True)
    settings = Settings(models_root=root, jobs_db_url=f"sqlite:///{tmp_path}/jobs.sqlite3")
    assert resolve_by_name(settings, "mine") == (root / "mine").resolve()
    assert resolve_by_name(settings, "lenet5-lle-vgn-mnist").name == "lenet5-lle-vgn-mnist"
    with pytest.raises(InvalidValue, match="is a symbolic link"):
        resolve_by_name(settings, "linked")
    with pytest.raises(NotFound, match="no model 'nothing'"):
        resolve_by_name(settings, "nothing")
    with pytest.raises(InvalidValue, match="invalid"):
        resolve_by_name(settings, "../mine")
    (root / "loop").symlink_to(root / "loop")  # a symlink loop was a 500
    with pytest.raises(InvalidValue, match="loop"):
        resolve_by_name(settings, "loop")
