"""The previews section's send action against crafted form fields (review of issue 38).

The fixtures of tests/test_dashboard_previews.py: real templates, Flask-Babel,
the dashboard's gate and CSRF token, the test SMTP server, both backends.
"""

from __future__ import annotations

import pytest
from conftest import rows
from flask import Flask
from smtpserver import FaultSMTPServer
from test_dashboard_previews import (  # noqa: F401 - fixtures
    SEND,
    Gate,
    gate,
    sending_app,
    token,
)

from flask_mail_outbox import OutboxMail


@pytest.mark.parametrize(("field", "value", "status"), [
    ("address", "dana@example.com, eve@example.com", 400),
    ("address", "dana@example.com\r\nBcc: eve@example.com", 400),
    ("address", "Dana <dana@example.com>, eve@example.com", 400),
    ("locale", "../../etc", 400),
    ("locale", "de\r\nX: y", 400),
    ("template", "../signup", 404),
    ("template", "orders/../signup", 404),
    ("template", "/etc/passwd", 404),
])
def test_a_crafted_send_reaches_one_address_with_a_known_template_or_nothing(
        sending_app: tuple[Flask, OutboxMail], smtp_server: FaultSMTPServer,  # noqa: F811 - fixtures
        field: str, value: str, status: int) -> None:
    app, _ = sending_app
    client = app.test_client()
    form = {"csrf_token": token(client), "template": "orders/shipped", "preview": "one item",
            "locale": "de", "address": "dana@example.com", field: value}
    if field == "template":
        form["preview"] = ""  # no preview to look for: the template name alone decides
    response = client.post(SEND, data=form)
    assert response.status_code == status, response.get_data(as_text=True)
    assert rows(app) == [] and smtp_server.messages == []
