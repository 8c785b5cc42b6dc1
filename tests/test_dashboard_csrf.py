"""The dashboard in an app protected by Flask-WTF's CSRFProtect (issue 36, defect 7).

CSRFProtect looked for a token of its own in every POST and refused each of the
dashboard's actions with 400 "The CSRF session token is missing". The
dashboard checks its own token; the blueprint is exempted from CSRFProtect,
whether the app sets CSRFProtect up before registering the blueprint or after.
The dashboard's own check still refuses a POST without its token, and the
app's own forms stay protected.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from conftest import close_app, make_app
from flask import Flask
from flask.testing import FlaskClient

PREFIX = "/outbox"


@pytest.fixture(params=["csrf-first", "csrf-after"])
def protected(request: pytest.FixtureRequest, db_url: str) -> Iterator[Flask]:
    from flask_wtf.csrf import CSRFProtect

    csrf = CSRFProtect()
    app = make_app(db_url, TESTING=True, WTF_CSRF_ENABLED=True, OUTBOX_RUN_SCHEDULER=False)
    mail = app.extensions["test_mail"]
    if request.param == "csrf-first":
        csrf.init_app(app)
    app.register_blueprint(mail.dashboard_blueprint(authorize=lambda: True),
                           url_prefix=PREFIX)

    @app.post("/form")
    def form() -> str:
        return "ok"

    if request.param == "csrf-after":  # an app factory's order: exempted at the first request
        csrf.init_app(app)
    yield app
    close_app(app, timeout=5)


def token(client: FlaskClient) -> str:
    page = client.get(f"{PREFIX}/").get_data(as_text=True)
    match = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert match is not None, "the page has no CSRF field"
    return match.group(1)


def test_the_dashboards_actions_work_under_csrfprotect(protected: Flask) -> None:
    client = protected.test_client()
    mail = protected.extensions["test_mail"]
    answer = client.post(f"{PREFIX}/mode", data={"mode": "durable", "csrf_token": token(client)})
    assert answer.status_code == 303, answer.get_data(as_text=True)
    with protected.app_context():
        assert mail.durable is True
    answer = client.post(f"{PREFIX}/suppressions/add",
                         data={"address": "gone@example.com", "csrf_token": token(client)})
    assert answer.status_code == 303
    with protected.app_context():
        assert mail.suppression("gone@example.com") is not None


def test_the_dashboards_own_check_and_the_apps_forms_stay_protected(protected: Flask) -> None:
    client = protected.test_client()
    mail = protected.extensions["test_mail"]
    refused = client.post(f"{PREFIX}/mode", data={"mode": "durable", "csrf_token": "forged"})
    assert refused.status_code == 400
    assert "does not match this session" in refused.get_data(as_text=True)
    with protected.app_context():
        assert mail.durable is False
    assert client.post("/form").status_code == 400  # CSRFProtect guards the app's own form
