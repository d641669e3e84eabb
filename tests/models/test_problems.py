"""The one formatter of validation errors (models.problems): the same words everywhere."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from models.problems import validation_problems


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    top_k: int
    mode: Literal["p", "q"] = "q"

    @field_validator("top_k")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("top_k must be at least 1")
        return v


def _errors(**data: object) -> list[dict]:
    with pytest.raises(ValidationError) as info:
        _Options(**data)
    return info.value.errors()


def test_each_problem_named_by_its_field_in_one_line() -> None:
    text = validation_problems(_errors(top_k=0, mode="x", colour=1))
    assert text == (
        "top_k: top_k must be at least 1; mode: Input should be 'p' or 'q'; "
        "colour: unknown field (Extra inputs are not permitted)"
    )


def test_skipped_location_parts_long_names_and_no_location() -> None:
    errors = [
        {"loc": ("body", "images", 0), "msg": "bad"},
        {"loc": ("query", "x" * 100), "msg": "unknown"},
        {"loc": (), "msg": "empty body"},
    ]
    assert validation_problems(errors, skip=("body", "query"), max_name=10, what="settings") == (
        "images.0: bad; xxxxxxx...: unknown; settings: empty body"
    )
    assert validation_problems([], what="config") == "invalid config"
