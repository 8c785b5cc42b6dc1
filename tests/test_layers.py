"""One registry row per provider, and no other module that names one.

``flask_mail_outbox._providers.PROVIDERS`` says what each provider kind is made
of (its transport, its webhook receiver, how the webhook authenticates, its
extra). Each layer resolves its own part from it; no other module of the
package spells a provider's kind, so adding a provider is adding a row (and
its two modules), and no layer's code changes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import MakeApps
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from flask_mail_outbox._providers import PROVIDERS, webhook_auth
from flask_mail_outbox._webhooks import Receiver, receiver_class
from flask_mail_outbox.transports import API_KINDS, Transport, transport_class

PACKAGE = Path(__file__).resolve().parent.parent / "flask_mail_outbox"
SENDGRID_KEY = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


@pytest.mark.parametrize("kind", sorted(PROVIDERS))
def test_each_row_resolves_to_its_transport_and_its_receiver(kind: str) -> None:
    provider = PROVIDERS[kind]
    transport = transport_class(kind, "K")
    assert issubclass(transport, Transport)
    assert f"{transport.__module__}:{transport.__qualname__}" == provider.transport
    receiver = receiver_class(kind)
    assert receiver is not None and issubclass(receiver, Receiver)
    assert f"{receiver.__module__}:{receiver.__qualname__}" == provider.receiver
    assert API_KINDS[kind] == provider.transport
    assert webhook_auth(kind) == provider.webhook_auth


def test_a_kind_without_a_row_has_no_webhook() -> None:
    assert receiver_class("smtp") is None and webhook_auth("smtp") is None


def _own_modules(kind: str) -> set[Path]:
    provider = PROVIDERS[kind]
    return {PACKAGE.parent / (target.partition(":")[0].replace(".", "/") + ".py")
            for target in (provider.transport, provider.receiver)}


def test_no_module_but_the_registry_and_the_providers_own_names_a_provider() -> None:
    registry = PACKAGE / "_providers.py"
    naming: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == registry or "versions" in path.parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                           ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and id(node) not in docstrings:
                for kind in PROVIDERS:
                    if node.value == kind and path not in _own_modules(kind):
                        naming.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {kind!r}")
    assert naming == []


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_only_a_basic_auth_webhook_asks_for_credentials(make_apps: MakeApps) -> None:
    """A 401 carries ``WWW-Authenticate: Basic`` where the row says the webhook uses it."""
    app, _ = make_apps(TESTING=True, OUTBOX_TRANSPORTS={
        "default": {"transport": "memory"},
        "pm": {"transport": "postmark", "token": "t", "webhook_secret": "user:pass"},
        "sg": {"transport": "sendgrid", "api_key": "k", "webhook_secret": SENDGRID_KEY}})
    client = app.test_client()
    asked = client.post("/outbox/webhooks/pm", data=b"{}")
    assert asked.status_code == 401
    assert asked.headers["WWW-Authenticate"].startswith("Basic ")
    signed = client.post("/outbox/webhooks/sg", data=b"[]")
    assert signed.status_code == 401
    assert "WWW-Authenticate" not in signed.headers
