"""outbox: search columns, failed_at, smtp_options and listing indexes for the dashboard

Revision ID: outbox_0002
Revises: outbox_0001
Create Date: 2026-11-30

Adds to ``outbox_email``:

* ``search_recipient`` / ``search_subject``: the first recipient and the subject,
  lower-cased and cut to 320 / 200 characters, each indexed with the id, so a prefix
  search is an index range scan (``"C"`` collation on PostgreSQL: byte order, as on
  SQLite). Existing rows are filled here.
* ``failed_at``: when a row was dead-lettered (the dashboard's failures per hour).
* ``smtp_options``: Flask-Mail's ``mail_options`` / ``rcpt_options`` of the message
  (JSON), passed to MAIL FROM and RCPT TO; NULL for existing rows (they had none).
* ``ix_outbox_email_status_id``: newest first within one status (keyset pages).

On PostgreSQL the columns are added in place, filled, and only then indexed. The
whole upgrade is one transaction holding ``ADD COLUMN``'s ACCESS EXCLUSIVE lock on
``outbox_email`` until it commits: ``send()``, delivery and every read of the table
wait for it (3.0 to 3.6 s per 100,000 rows measured; see the README). The fill is one
set-based UPDATE for the rows whose recipient and subject are ASCII (lower-cased
under the "C" collation, exactly as Python lower-cases ASCII); the rest, where the
database's lower() could differ from Python's, are filled from Python.

SQLite cannot add a column between the existing ones and its constraints, so the
table is rebuilt (renamed
aside, created as ``create_all`` would, copied, dropped) and its schema stays
exactly what the models create; ``outbox_attachment``'s foreign key is left as it is
(``legacy_alter_table`` keeps the rename from rewriting it).

Frozen history: imports nothing from the package (see outbox_0001).
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.schema import CreateIndex, CreateTable

# revision identifiers, used by Alembic.
revision = "outbox_0002"
down_revision: str | None = "outbox_0001"
branch_labels: tuple[str, ...] | None = None
depends_on: str | None = None

# SQLite only auto-increments an INTEGER PRIMARY KEY, not BIGINT.
_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_RECIPIENT_LENGTH = 320
_SUBJECT_LENGTH = 200
_BATCH = 1000
_NEW_INDEXES = (
    ("ix_outbox_email_status_id", ("status", "id")),
    ("ix_outbox_email_search_recipient", ("search_recipient", "id")),
    ("ix_outbox_email_search_subject", ("search_subject", "id")),
)


def _search_text(length: int) -> Any:
    return sa.String(length).with_variant(sa.String(length, collation="C"), "postgresql")


def _new_columns() -> list[sa.Column[Any]]:
    return [
        sa.Column("search_recipient", _search_text(_RECIPIENT_LENGTH), nullable=True),
        sa.Column("search_subject", _search_text(_SUBJECT_LENGTH), nullable=True),
        sa.Column("failed_at", sa.DateTime(), nullable=True),
        sa.Column("smtp_options", sa.Text(), nullable=True),
    ]


def _where(clause: str) -> dict[str, Any]:
    return {"sqlite_where": sa.text(clause), "postgresql_where": sa.text(clause)}


def _email_table() -> sa.Table:
    """``outbox_email`` as it is at this revision (for SQLite's rebuild)."""
    metadata = sa.MetaData(naming_convention={
        "ix": "ix_%(column_0_label)s",
        "pk": "pk_%(table_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s",
    })
    return sa.Table(
        "outbox_email",
        metadata,
        sa.Column("id", _BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("due_at", sa.DateTime(), nullable=False),
        sa.Column("sent_at", sa.DateTime(), nullable=True),
        sa.Column("message_id", sa.String(255), nullable=False),
        sa.Column("key", sa.String(255), nullable=True),
        sa.Column("key_head", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("error_history", sa.Text(), nullable=True),
        sa.Column("lease_owner", sa.String(96), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(), nullable=True),
        sa.Column("sender", sa.String(320), nullable=False),
        sa.Column("recipients", sa.Text(), nullable=False),
        sa.Column("subject", sa.Text(), nullable=False, server_default=""),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("mime", sa.LargeBinary(), nullable=True),
        *_new_columns(),
        sa.CheckConstraint(
            "status IN ('queued', 'sending', 'sent', 'failed')", name="ck_outbox_email_status"
        ),
        sa.UniqueConstraint("idempotency_key", name="uq_outbox_email_idempotency_key"),
        sa.Index(
            "ix_outbox_email_due",
            "due_at",
            "id",
            **_where("status = 'queued' AND (key IS NULL OR key_head)"),
        ),
        sa.Index(
            "ix_outbox_email_queued_created", "created_at", "id", **_where("status = 'queued'")
        ),
        sa.Index("ix_outbox_email_lease", "lease_expires_at", **_where("status = 'sending'")),
        sa.Index(
            "ix_outbox_email_key_open",
            "key",
            "id",
            **_where("status IN ('queued', 'sending') AND key IS NOT NULL"),
        ),
        sa.Index("ix_outbox_email_failed", "id", **_where("status = 'failed'")),
        sa.Index("ix_outbox_email_sent_at", "sent_at", **_where("status = 'sent'")),
        *[sa.Index(name, *columns) for name, columns in _NEW_INDEXES],
    )


def _rebuild_sqlite() -> None:
    table = _email_table()
    old_columns = ", ".join(
        f'"{column.name}"' for column in table.columns
        if column.name not in ("search_recipient", "search_subject", "failed_at", "smtp_options")
    )
    op.execute("PRAGMA legacy_alter_table = ON")
    op.execute("ALTER TABLE outbox_email RENAME TO _outbox_email_0001")
    op.execute(CreateTable(table))
    op.execute(
        f"INSERT INTO outbox_email ({old_columns}) SELECT {old_columns} FROM _outbox_email_0001"
    )
    op.execute("DROP TABLE _outbox_email_0001")  # its indexes go with it
    op.execute("PRAGMA legacy_alter_table = OFF")
    for index in sorted(table.indexes, key=lambda index: str(index.name)):
        op.execute(CreateIndex(index))


def _search_key(text: str, length: int) -> str:
    # The package's search_key(): lower-cased, cut to length.
    return text.lower()[:length]


# One UPDATE per dialect for every row whose first recipient and subject are ASCII
# (UTF-8 byte length equal to character length): lower-casing ASCII is the same in
# SQL (the "C" collation on PostgreSQL, SQLite's built-in lower()) as in Python, and
# so is cutting to 320 / 200 characters (_RECIPIENT_LENGTH / _SUBJECT_LENGTH).
_FILL_ASCII_ROWS = {
    "postgresql": (
        "UPDATE outbox_email SET"
        " search_recipient = left(lower(coalesce(recipients::json->>0, '') COLLATE \"C\"), 320),"
        " search_subject = left(lower(subject COLLATE \"C\"), 200)"
        " WHERE octet_length(coalesce(recipients::json->>0, ''))"
        " = char_length(coalesce(recipients::json->>0, ''))"
        " AND octet_length(subject) = char_length(subject)"
    ),
    "sqlite": (
        "UPDATE outbox_email SET"
        " search_recipient = substr(lower(coalesce(json_extract(recipients, '$[0]'), '')),"
        " 1, 320),"
        " search_subject = substr(lower(subject), 1, 200)"
        " WHERE length(CAST(coalesce(json_extract(recipients, '$[0]'), '') AS BLOB))"
        " = length(coalesce(json_extract(recipients, '$[0]'), ''))"
        " AND length(CAST(subject AS BLOB)) = length(subject)"
    ),
}


def _fill_search_columns() -> None:
    """Existing rows get the values ``send()`` gives new ones.

    The ASCII rows (nearly all, usually) in one set-based statement; the others
    in batches by id from Python, whose lower() is the package's.
    """
    if context.is_offline_mode():
        # `upgrade --sql` reads no rows: the database's lower() is the best SQL can do
        # (on SQLite it lower-cases ASCII only).
        first = ("recipients::json->>0" if op.get_context().dialect.name == "postgresql"
                 else "json_extract(recipients, '$[0]')")
        op.execute(
            "UPDATE outbox_email SET "
            f"search_recipient = substr(lower(coalesce({first}, '')), 1, {_RECIPIENT_LENGTH}), "
            f"search_subject = substr(lower(subject), 1, {_SUBJECT_LENGTH})"
        )
        return
    email = sa.table(
        "outbox_email",
        sa.column("id", sa.BigInteger()),
        sa.column("recipients", sa.Text()),
        sa.column("subject", sa.Text()),
        sa.column("search_recipient", sa.String()),
        sa.column("search_subject", sa.String()),
    )
    fill = (
        email.update()
        .where(email.c.id == sa.bindparam("row_id"))
        .values(search_recipient=sa.bindparam("recipient"), search_subject=sa.bindparam("subj"))
    )
    bind = op.get_bind()
    op.execute(_FILL_ASCII_ROWS[bind.dialect.name])
    last = 0
    while True:
        rows = bind.execute(
            sa.select(email.c.id, email.c.recipients, email.c.subject)
            .where(email.c.id > last, email.c.search_recipient.is_(None))
            .order_by(email.c.id).limit(_BATCH)
        ).all()
        if not rows:
            return
        params = []
        for row in rows:
            recipients = json.loads(row.recipients)
            first = recipients[0] if recipients else ""
            params.append({
                "row_id": row.id,
                "recipient": _search_key(first, _RECIPIENT_LENGTH),
                "subj": _search_key(row.subject, _SUBJECT_LENGTH),
            })
        bind.execute(fill, params)
        last = rows[-1].id


def upgrade() -> None:
    if op.get_context().dialect.name == "sqlite":
        _rebuild_sqlite()
        _fill_search_columns()
        return
    for column in _new_columns():
        op.add_column("outbox_email", column)
    # Filled before the indexes exist: one index build each, not an entry per update.
    _fill_search_columns()
    for name, columns in _NEW_INDEXES:
        op.create_index(name, "outbox_email", list(columns))


def downgrade() -> None:
    for name, _ in _NEW_INDEXES:
        op.drop_index(name, table_name="outbox_email")
    for column in ("smtp_options", "failed_at", "search_subject", "search_recipient"):
        op.drop_column("outbox_email", column)
