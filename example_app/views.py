"""The signup page, and the page that thanks you for signing up.

A signup sends the welcome email, the template ``welcome`` (templates/email/), in the
language picked on the form; "your browser's language" leaves the choice to
Flask-Babel's locale selector (the Accept-Language header, see ``create_app``).
"""

from __future__ import annotations

import sqlalchemy as sa
from babel import Locale
from flask import (
    Blueprint,
    current_app,
    flash,
    redirect,
    render_template,
    request,
    url_for,
)
from flask.typing import ResponseReturnValue
from sqlalchemy.exc import IntegrityError

from example_app.extensions import db, mail
from example_app.models import User
from flask_mail_outbox import InvalidMessage

bp = Blueprint("example", __name__)

MAX_NAME_LENGTH = 100
MAX_EMAIL_LENGTH = 320
RECENT_SIGNUPS = 10


@bp.get("/")
def signup_form() -> ResponseReturnValue:
    return _form(name="", email="", locale="")


@bp.post("/")
def signup() -> ResponseReturnValue:
    name = request.form.get("name", "").strip()
    # One account per address, whatever its case.
    email = request.form.get("email", "").strip().lower()
    # A locale the emails are written in, or "" for the browser's language.
    locale = request.form.get("locale", "")

    problems = _form_problems(name, email, locale)
    if not problems and _already_signed_up(email):
        problems.append("That email address has already signed up.")
    if problems:
        return _form_again(name, email, locale, problems)

    user = User(name=name, email=email)
    db.session.add(user)
    try:
        # The unique constraint catches a signup of the same address that committed
        # between the check above and now.
        db.session.flush()
    except IntegrityError:
        db.session.rollback()
        return _form_again(name, email, locale, ["That email address has already signed up."])

    try:
        # Rendered here, in this request: the subject, the HTML (its <style> inlined) and
        # the text, in `locale`, or when that is None in Flask-Babel's locale for this
        # request. Joins this transaction: the user row and the email row commit
        # together, and delivery starts after the commit. The key: one welcome email per
        # user, even if this ran twice for them.
        mail.send_template(
            "welcome",
            recipients=[(user.name, user.email)],
            context={"user": user},
            locale=locale or None,
            idempotency_key=f"welcome-{user.id}",
        )
    except InvalidMessage as exc:  # a bad address; a TemplateError is one too
        db.session.rollback()
        return _form_again(name, email, locale, [str(exc)])
    db.session.commit()

    flash(f"Thanks, {user.name}! A welcome email is on its way to {user.email}.", "success")
    return redirect(url_for(".thanks"))


@bp.get("/thanks")
def thanks() -> ResponseReturnValue:
    recent = db.session.scalars(
        sa.select(User).order_by(User.id.desc()).limit(RECENT_SIGNUPS)
    ).all()
    # In development the welcome email goes to the outbox's own inbox, not to anyone.
    in_mailbox = current_app.config.get("OUTBOX_TRANSPORT") == "mailbox"
    mailbox_url = url_for("outbox_dashboard.mailbox") if in_mailbox else None
    return render_template("thanks.html", recent=recent, mailbox_url=mailbox_url)


def _languages() -> list[tuple[str, str]]:
    """``(locale, its name in that language)`` for each locale the emails are written in.

    The outbox's list (``OUTBOX_TEMPLATE_LOCALES``, by default Flask-Babel's
    translations), the default locale first: a new catalog in translations/ shows here.
    """
    return [(code, Locale.parse(code).get_display_name(code) or code)
            for code in mail.templates().locales()]


def _form_problems(name: str, email: str, locale: str) -> list[str]:
    """What is wrong with the form, in words for the person filling it in."""
    problems = []
    if not name:
        problems.append("Please enter your name.")
    elif len(name) > MAX_NAME_LENGTH:
        problems.append(f"Please shorten your name to {MAX_NAME_LENGTH} characters.")
    elif any(ch in name for ch in "\r\n\0"):
        problems.append("Please write your name on one line.")
    if not email:
        problems.append("Please enter your email address.")
    elif len(email) > MAX_EMAIL_LENGTH:
        problems.append("That email address is too long.")
    if locale and locale not in dict(_languages()):
        problems.append("Please choose a language from the list.")
    return problems


def _already_signed_up(email: str) -> bool:
    return db.session.scalar(sa.select(User.id).where(User.email == email)) is not None


def _form(name: str, email: str, locale: str) -> str:
    return render_template("signup.html", name=name, email=email, locale=locale,
                           languages=_languages())


def _form_again(name: str, email: str, locale: str,
                problems: list[str]) -> ResponseReturnValue:
    for problem in problems:
        flash(problem, "error")
    return _form(name, email, locale), 400
