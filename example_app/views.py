"""The signup page, and the page that thanks you for signing up."""

from __future__ import annotations

import sqlalchemy as sa
from flask import Blueprint, flash, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue
from sqlalchemy.exc import IntegrityError

from example_app.extensions import db, mail
from example_app.models import User
from flask_mail_outbox import InvalidMessage, Message

bp = Blueprint("example", __name__)

MAX_NAME_LENGTH = 100
MAX_EMAIL_LENGTH = 320
RECENT_SIGNUPS = 10


@bp.get("/")
def signup_form() -> ResponseReturnValue:
    return render_template("signup.html", name="", email="")


@bp.post("/")
def signup() -> ResponseReturnValue:
    name = request.form.get("name", "").strip()
    # One account per address, whatever its case.
    email = request.form.get("email", "").strip().lower()

    problems = _form_problems(name, email)
    if not problems and _already_signed_up(email):
        problems.append("That email address has already signed up.")
    if problems:
        return _form_again(name, email, problems)

    user = User(name=name, email=email)
    db.session.add(user)
    try:
        # The unique constraint catches a signup of the same address that committed
        # between the check above and now.
        db.session.flush()
    except IntegrityError:
        db.session.rollback()
        return _form_again(name, email, ["That email address has already signed up."])

    try:
        # Joins this transaction: the user row and the email row commit together, and
        # delivery starts after the commit. The key: one welcome email per user, even if
        # this ran twice for them.
        mail.send(_welcome_message(user), idempotency_key=f"welcome-{user.id}")
    except InvalidMessage as exc:
        db.session.rollback()
        return _form_again(name, email, [str(exc)])
    db.session.commit()

    flash(f"Thanks, {user.name}! A welcome email is on its way to {user.email}.", "success")
    return redirect(url_for(".thanks"))


@bp.get("/thanks")
def thanks() -> ResponseReturnValue:
    recent = db.session.scalars(
        sa.select(User).order_by(User.id.desc()).limit(RECENT_SIGNUPS)
    ).all()
    return render_template("thanks.html", recent=recent)


def _form_problems(name: str, email: str) -> list[str]:
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
    return problems


def _already_signed_up(email: str) -> bool:
    return db.session.scalar(sa.select(User.id).where(User.email == email)) is not None


def _form_again(name: str, email: str, problems: list[str]) -> ResponseReturnValue:
    for problem in problems:
        flash(problem, "error")
    return render_template("signup.html", name=name, email=email), 400


def _welcome_message(user: User) -> Message:
    context = {"user": user, "site_url": url_for(".signup_form", _external=True)}
    return Message(
        subject=f"Welcome, {user.name}!",
        recipients=[(user.name, user.email)],
        body=render_template("email/welcome.txt", **context),
        html=render_template("email/welcome.html", **context),
    )
