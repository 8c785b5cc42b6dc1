"""outbox: running totals of the terminal statuses, kept by triggers (outbox_tally)

Revision ID: outbox_0008
Revises: outbox_0007
Create Date: 2026-12-06

Creates ``outbox_tally`` and the triggers on ``outbox_email`` that keep it, then
counts the rows already there into it (the backfill). The dashboard's overview
and ``flask outbox status`` read ``sent``, ``suppressed``, ``expired`` and
``cancelled`` from it instead of counting those rows, which grow with history.

PostgreSQL: one function, ``outbox_tally_rows()``, and statement-level triggers
(INSERT, UPDATE, DELETE with transition tables; TRUNCATE) that append one row
per status and hour a statement changed. ``CREATE TRIGGER`` takes a SHARE ROW
EXCLUSIVE lock on ``outbox_email`` until the migration commits: writes (``send()``,
delivery) wait for the backfill, one scan of the table's terminal rows; reads
do not. SQLite: three row-level triggers that update the totals in place; the
migration holds the database's write lock throughout. A downgrade drops the
triggers, the function and the table; nothing else changes.

Frozen history: imports nothing from the package (see outbox_0001). The trigger
text below is what ``flask_mail_outbox.core._models.TALLY_DDL`` was at this
revision (a test compares the migrated catalog with ``create_all``'s).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision = "outbox_0008"
down_revision: str | None = "outbox_0007"
branch_labels: tuple[str, ...] | None = None
depends_on: str | None = None

TALLIED = ("sent", "suppressed", "expired", "cancelled")
TALLIED_SQL = "('sent', 'suppressed', 'expired', 'cancelled')"
TALLY_LOCK = (0x7461, 0)

_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

_PG_HOUR = ("CASE WHEN status = 'sent'"
            " THEN CAST(floor(extract(epoch FROM sent_at) / 3600) AS bigint) END")
_PG_FUNCTION = f"""\
CREATE OR REPLACE FUNCTION outbox_tally_rows() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    fold boolean;
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        PERFORM pg_advisory_xact_lock({TALLY_LOCK[0]}, {TALLY_LOCK[1]});
        DELETE FROM outbox_tally;
        RETURN NULL;
    ELSIF TG_OP = 'INSERT' THEN
        INSERT INTO outbox_tally (status, sent_hour, n)
        SELECT status, {_PG_HOUR}, count(*) FROM new_rows
        WHERE status IN {TALLIED_SQL} GROUP BY 1, 2;
        RETURN NULL;
    ELSIF TG_OP = 'DELETE' THEN
        WITH added AS (
            INSERT INTO outbox_tally (status, sent_hour, n)
            SELECT status, {_PG_HOUR}, -count(*) FROM old_rows
            WHERE status IN {TALLIED_SQL} GROUP BY 1, 2
            RETURNING id)
        SELECT bool_or(mod(id, 64) = 0) INTO fold FROM added;
    ELSE
        WITH added AS (
            INSERT INTO outbox_tally (status, sent_hour, n)
            SELECT status, sent_hour, sum(n) FROM (
                SELECT status, {_PG_HOUR} AS sent_hour, -1 AS n FROM old_rows
                WHERE status IN {TALLIED_SQL}
                UNION ALL
                SELECT status, {_PG_HOUR}, 1 FROM new_rows
                WHERE status IN {TALLIED_SQL}) AS moved
            GROUP BY status, sent_hour HAVING sum(n) <> 0
            RETURNING id)
        SELECT bool_or(mod(id, 64) = 0) INTO fold FROM added;
    END IF;
    -- Only where each statement sees what the last fold committed (READ COMMITTED):
    -- a REPEATABLE READ snapshot may hold rows another fold deleted since.
    IF fold AND current_setting('transaction_isolation') = 'read committed'
            AND pg_try_advisory_xact_lock({TALLY_LOCK[0]}, {TALLY_LOCK[1]}) THEN
        WITH keys AS (
            SELECT status, coalesce(sent_hour, -1) AS hour FROM outbox_tally
            GROUP BY 1, 2 HAVING count(*) > 1),
        folded AS (
            DELETE FROM outbox_tally
            WHERE (status, coalesce(sent_hour, -1)) IN (SELECT status, hour FROM keys)
            RETURNING status, sent_hour, n)
        INSERT INTO outbox_tally (status, sent_hour, n)
        SELECT status, sent_hour, sum(n) FROM folded
        GROUP BY status, sent_hour HAVING sum(n) <> 0;
    END IF;
    RETURN NULL;
END
$$"""


def _pg_trigger(event: str, referencing: str) -> str:
    return (f"CREATE TRIGGER outbox_tally_{event.lower()} AFTER {event} ON outbox_email"
            f" REFERENCING {referencing} FOR EACH STATEMENT EXECUTE FUNCTION outbox_tally_rows()")


def _sqlite_tallied(column: str) -> str:
    return "(" + " OR ".join(f"{column} = '{status}'" for status in TALLIED) + ")"


def _sqlite_add(row: str, sign: str) -> str:
    hour = (f"CASE WHEN {row}.status = 'sent'"
            f" THEN CAST(strftime('%s', {row}.sent_at) AS INTEGER) / 3600 END")
    return (f"    UPDATE outbox_tally SET n = n {sign} 1"
            f" WHERE status = {row}.status AND sent_hour IS {hour};\n"
            f"    INSERT INTO outbox_tally (status, sent_hour, n) SELECT {row}.status, {hour}, {sign}1"
            f" WHERE {_sqlite_tallied(row + '.status')} AND NOT EXISTS (SELECT 1 FROM outbox_tally"
            f" WHERE status = {row}.status AND sent_hour IS {hour});\n")


def _sqlite_trigger(event: str, when: str, body: str) -> str:
    return (f"CREATE TRIGGER outbox_tally_{event.split()[0].lower()} AFTER {event}"
            f" ON outbox_email\nWHEN {when}\nBEGIN\n{body}END")


TRIGGERS = {
    "postgresql": (
        _PG_FUNCTION,
        _pg_trigger("INSERT", "NEW TABLE AS new_rows"),
        _pg_trigger("UPDATE", "OLD TABLE AS old_rows NEW TABLE AS new_rows"),
        _pg_trigger("DELETE", "OLD TABLE AS old_rows"),
        "CREATE TRIGGER outbox_tally_truncate AFTER TRUNCATE ON outbox_email"
        " FOR EACH STATEMENT EXECUTE FUNCTION outbox_tally_rows()",
    ),
    "sqlite": (
        _sqlite_trigger("INSERT", _sqlite_tallied("NEW.status"), _sqlite_add("NEW", "+")),
        _sqlite_trigger(
            "UPDATE OF status, sent_at",
            f"({_sqlite_tallied('OLD.status')} OR {_sqlite_tallied('NEW.status')})"
            " AND (OLD.status IS NOT NEW.status OR OLD.sent_at IS NOT NEW.sent_at)",
            _sqlite_add("OLD", "-") + _sqlite_add("NEW", "+")),
        _sqlite_trigger("DELETE", _sqlite_tallied("OLD.status"), _sqlite_add("OLD", "-")),
    ),
}

#: The backfill: the tallied rows counted per status and hour, as the triggers would have.
BACKFILL = {
    "postgresql": f"INSERT INTO outbox_tally (status, sent_hour, n) SELECT status, {_PG_HOUR},"
                  f" count(*) FROM outbox_email WHERE status IN {TALLIED_SQL} GROUP BY 1, 2",
    "sqlite": "INSERT INTO outbox_tally (status, sent_hour, n) SELECT status, CASE WHEN"
              " status = 'sent' THEN CAST(strftime('%s', sent_at) AS INTEGER) / 3600 END,"
              f" count(*) FROM outbox_email WHERE status IN {TALLIED_SQL} GROUP BY 1, 2",
}


def upgrade() -> None:
    dialect = op.get_context().dialect.name
    op.create_table(
        "outbox_tally",
        sa.Column("id", _BIG_ID, autoincrement=True, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("sent_hour", sa.BigInteger(), nullable=True),
        sa.Column("n", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_tally"),
    )
    op.create_index("ix_outbox_tally_status_sent_hour", "outbox_tally", ["status", "sent_hour"])
    # Triggers first, then the count: on PostgreSQL CREATE TRIGGER makes writers
    # wait until this commits, so no change falls between the two. On SQLite a
    # write first takes the database's write lock (the driver begins no
    # transaction before DDL, so CREATE TRIGGER alone would commit at once).
    if dialect == "sqlite":
        op.execute("DELETE FROM outbox_tally")
    for statement in TRIGGERS.get(dialect, ()):
        op.execute(statement)
    if dialect in BACKFILL:
        op.execute(BACKFILL[dialect])


def downgrade() -> None:
    if op.get_context().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS outbox_tally_insert ON outbox_email")
        op.execute("DROP TRIGGER IF EXISTS outbox_tally_update ON outbox_email")
        op.execute("DROP TRIGGER IF EXISTS outbox_tally_delete ON outbox_email")
        op.execute("DROP TRIGGER IF EXISTS outbox_tally_truncate ON outbox_email")
        op.execute("DROP FUNCTION IF EXISTS outbox_tally_rows()")
    else:
        op.execute("DROP TRIGGER IF EXISTS outbox_tally_insert")
        op.execute("DROP TRIGGER IF EXISTS outbox_tally_update")
        op.execute("DROP TRIGGER IF EXISTS outbox_tally_delete")
    op.drop_index("ix_outbox_tally_status_sent_hour", table_name="outbox_tally")
    op.drop_table("outbox_tally")
