"""Previews of the example's emails: the dashboard's previews section shows each one
in every locale (``/outbox/``), and ``flask outbox templates check`` renders them.

A preview function takes no arguments and returns the context the template is
rendered with: here an unsaved ``User``, so a preview writes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from example_app.extensions import mail
from example_app.models import User


@mail.preview("welcome")
def welcome() -> Mapping[str, Any]:
    """The welcome email, as a signup sends it."""
    return {"user": User(name="Ann Example", email="ann@example.com")}
