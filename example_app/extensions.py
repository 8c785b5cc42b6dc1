"""The extension objects, created unbound and bound to an app in ``create_app``."""

from __future__ import annotations

from flask_babel import Babel
from flask_migrate import Migrate  # type: ignore[import-untyped]
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import MetaData
from sqlalchemy.orm import DeclarativeBase

from flask_mail_outbox import OutboxMail
from flask_mail_outbox.migrations import guard_package_versions


class Base(DeclarativeBase):
    """Declarative base of the example's own tables.

    Named constraints, so a later migration can drop or alter them by name (SQLite's
    batch mode needs the names).
    """

    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(column_0_label)s",
            "uq": "uq_%(table_name)s_%(column_0_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )


db = SQLAlchemy(model_class=Base)
migrate = Migrate()
# A revision on the outbox branch (a merge, `revision --head outbox@head`) would be written
# into the package's own folder, which is this checkout's in an editable install: refused.
migrate.configure(guard_package_versions)
babel = Babel()
mail = OutboxMail()
