"""Flask-Migrate environment of example_app, wired to the library's ``outbox`` branch.

This is Flask-Migrate's stock ``flask`` template with the outbox hook added (and two
fixes: ``db.engine`` instead of the deprecated ``db.get_engine()``, and no logging
reconfiguration when logging is already set up). To do the same in your own project:

1. ``migrations/alembic.ini``, under ``[alembic]``: let Alembic see the branch that ships
   inside the package (Alembic reads this before env.py runs, so it cannot be set here)::

       path_separator = ;
       version_locations = %(here)s/versions;flask_mail_outbox.migrations:versions

2. ``migrations/env.py`` (this file): pass the library's ``include_object`` hook to
   ``context.configure``, so ``flask db migrate`` never proposes to drop or alter the
   outbox tables (they are not in your ``db.metadata``; the branch migrates them). See
   ``combine_include_object`` below for a project that has a hook of its own.

3. Create the tables: ``flask db upgrade heads`` (every branch: this app's and the
   outbox's).

The outbox branch stays a head of its own beside this app's history, never merged:
``migrations/versions/example_0001_users.py`` (the root of the ``example`` branch)
declares ``depends_on = "outbox_0001"``. When a new release of flask-mail-outbox adds an
outbox revision, ``flask --app example_app db upgrade heads`` applies it; nothing is
written here. A new revision of the app: ``flask --app example_app db migrate -m "..."
--head example@head``. See docs/migrations.md.
"""

import logging
from logging.config import fileConfig

from alembic import context
from flask import current_app

from flask_mail_outbox.migrations import combine_include_object

# this is the Alembic Config object, which provides
# access to the values within the .ini file in use.
config = context.config

# Interpret the config file for Python logging when run as `flask db ...` on the command
# line. When logging is already set up (by the application, or by pytest) leave it
# alone: fileConfig would replace the root handlers, and by default it disables every
# logger that already exists, the library's own included.
if config.config_file_name is not None and not logging.getLogger().handlers:
    fileConfig(config.config_file_name, disable_existing_loggers=False)
logger = logging.getLogger("alembic.env")


# The app's own tables only. The outbox tables are on the library's own MetaData and are
# migrated by the `outbox` branch; include_object (below) keeps autogenerate off them.
target_db = current_app.extensions["migrate"].db


def get_engine():
    # Flask-SQLAlchemy 3 (its get_engine() is deprecated).
    return target_db.engine


def get_engine_url():
    return get_engine().url.render_as_string(hide_password=False).replace("%", "%%")


config.set_main_option("sqlalchemy.url", get_engine_url())


def get_metadata():
    return target_db.metadata


def get_configure_args():
    """Flask-Migrate's ``Migrate(..., **kwargs)`` options, plus the outbox hook.

    A copy: the dict lives on the app, and this file runs once per command.
    """
    conf_args = dict(current_app.extensions["migrate"].configure_args)
    # Excludes outbox_email, outbox_attachment, outbox_setting and everything on them,
    # then defers to Migrate(include_object=...) if the app passed one.
    conf_args["include_object"] = combine_include_object(conf_args.get("include_object"))
    return conf_args


def run_migrations_offline():
    """Run migrations in 'offline' mode.

    This configures the context with just a URL
    and not an Engine, though an Engine is acceptable
    here as well.  By skipping the Engine creation
    we don't even need a DBAPI to be available.

    Calls to context.execute() here emit the given string to the
    script output.

    """
    url = config.get_main_option("sqlalchemy.url")
    context.configure(
        url=url,
        target_metadata=get_metadata(),
        literal_binds=True,
        include_object=get_configure_args()["include_object"],
    )

    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online():
    """Run migrations in 'online' mode.

    In this scenario we need to create an Engine
    and associate a connection with the context.

    """

    # this callback is used to prevent an auto-migration from being generated
    # when there are no changes to the schema
    # reference: http://alembic.zzzcomputing.com/en/latest/cookbook.html
    def process_revision_directives(context, revision, directives):
        if getattr(config.cmd_opts, "autogenerate", False):
            script = directives[0]
            if script.upgrade_ops.is_empty():
                directives[:] = []
                logger.info("No changes in schema detected.")

    conf_args = get_configure_args()
    if conf_args.get("process_revision_directives") is None:
        conf_args["process_revision_directives"] = process_revision_directives

    connectable = get_engine()

    with connectable.connect() as connection:
        context.configure(connection=connection, target_metadata=get_metadata(), **conf_args)

        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
