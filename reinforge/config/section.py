"""The base class of every config section.

It lives in its own module so that a component can define its config class next to its code
(STYLE.md #6) without importing the whole schema.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, field docstrings are descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
