"""The outbox schema's Alembic revisions, shipped as a branch labelled ``outbox``.

The revisions live in :data:`VERSIONS_DIR`, a plain folder inside the installed
package. A Flask-Migrate project (``pip install 'flask-mail-outbox[migrate]'``; this
module itself needs neither Flask-Migrate nor Alembic) uses them in three steps.

1. Let Alembic find the branch: in ``migrations/alembic.ini``, under ``[alembic]``::

       path_separator = ;
       version_locations = %(here)s/versions;flask_mail_outbox.migrations:versions

   ``flask_mail_outbox.migrations:versions`` is Alembic's ``package:path`` form: it is
   resolved to the installed package's folder, so the line works in every checkout and
   virtualenv. Alembic reads ``version_locations`` before ``env.py`` runs, which is why it
   belongs in ``alembic.ini``. The separator must not be ``:`` (nor ``os`` on POSIX), or
   the ``package:path`` entry would be split in two.

2. Keep autogenerate away from the outbox tables: in ``migrations/env.py``, pass the hook
   to ``context.configure``::

       from . import include_object

       context.configure(connection=connection, target_metadata=get_metadata(),
                         include_object=include_object, **conf_args)

   If you already have an ``include_object`` hook, pass
   ``combine_include_object(your_hook)`` instead.

3. Keep your revisions out of the package: in the same ``@migrate.configure`` hook (or
   wherever the config is made), ``guard_package_versions(config)``. With two version
   locations Alembic writes a new revision into the folder of the first head it builds
   on, and for ``flask db merge outbox@head app@head`` or ``flask db revision --head
   outbox@head`` that is this package's: a revision of yours lost with the next install
   (or, in an editable install, written into a checkout of the library). The guard
   removes such a file at once and stops the command with what to do instead.

4. Create the tables: ``flask db upgrade heads``.

Your history and the ``outbox`` branch stay two heads, never merged: a revision of yours
that needs the outbox tables declares ``depends_on = "outbox_0001"``. When an upgrade of
flask-mail-outbox brings a new outbox revision, ``flask db upgrade heads`` applies it and
you write nothing. ``flask db migrate`` needs to be told which head to build on:
``flask db migrate --head <your-branch-label>@head``. docs/migrations.md has the recipes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from sqlalchemy import exc as sa_exc

from ..core._internal import TABLE_NAMES

__all__ = ["BRANCH_LABEL", "VERSIONS_DIR", "combine_include_object", "guard_package_versions",
           "include_object"]

#: Absolute path of the folder holding the ``outbox`` branch's revision files.
VERSIONS_DIR: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "versions")

#: The branch label of the outbox revisions: ``flask db upgrade outbox@head``.
BRANCH_LABEL = "outbox"

IncludeObject = Callable[[Any, str | None, str, bool, Any], bool]

#: The guard's name in Alembic's registry of post-write hooks (its ``type``).
GUARD_HOOK_TYPE = "flask_mail_outbox_guard"
#: The guard's name in the config's ``[post_write_hooks]`` section.
_GUARD_HOOK_NAME = "outbox_guard"


def guard_package_versions(config: Any) -> Any:
    """Make Alembic refuse a new revision written into the package's own folder; ``config``.

    For Flask-Migrate, call it in your ``@migrate.configure`` hook (it returns the config,
    so ``migrate.configure(guard_package_versions)`` works too). It adds a post-write hook,
    first in ``[post_write_hooks]`` (a formatter of yours still runs on your revisions).
    Alembic runs it on every file that ``revision``, ``migrate`` or ``merge`` writes; a
    file in :data:`VERSIONS_DIR` is deleted and the command fails with
    ``alembic.util.CommandError`` saying what to run instead. Alembic has no option to
    choose the folder of a merge: it takes that of the first head named, which is why the
    file is refused rather than moved. Post-write hooks set in ``pyproject.toml`` (Alembic
    1.16) are not read once this adds its ``.ini`` section: name them in
    ``alembic.ini`` instead.
    """
    from alembic.script import write_hooks

    write_hooks.register(GUARD_HOOK_TYPE)(_refuse_a_revision_in_the_package)
    section = "post_write_hooks"
    named = (config.get_section_option(section, "hooks") or ""
             if config.file_config.has_section(section) else "")
    hooks = [name for name in named.replace(",", " ").split() if name != _GUARD_HOOK_NAME]
    config.set_section_option(section, "hooks", ", ".join([_GUARD_HOOK_NAME, *hooks]))
    config.set_section_option(section, f"{_GUARD_HOOK_NAME}.type", GUARD_HOOK_TYPE)
    return config


def _refuse_a_revision_in_the_package(path: str, options: Any) -> None:
    """The post-write hook: delete a revision file written into :data:`VERSIONS_DIR`."""
    written = os.path.realpath(path)
    if os.path.dirname(written) != os.path.realpath(VERSIONS_DIR):
        return
    os.remove(written)
    from alembic.util import CommandError

    raise CommandError(
        f"Alembic wrote the new revision {os.path.basename(written)} into flask-mail-outbox's "
        f"own folder ({VERSIONS_DIR}) because it builds on the outbox branch's head; it was "
        "deleted (the next install of the package would lose it). Write your revisions on "
        "your own branch: `flask db migrate --head app@head` or `flask db revision --head "
        "app@head`, with `--version-path migrations/versions` when Alembic asks. Do not "
        "merge the outbox branch: a revision that needs its tables declares "
        "depends_on = \"outbox_0001\" (docs/migrations.md)")


def _table_name_of(object: Any, name: str | None, type_: str) -> str | None:
    """The name of the table that ``object`` is or belongs to, or None when it has none."""
    if type_ == "table":
        return name
    try:
        table = object.table
    except (AttributeError, sa_exc.InvalidRequestError):  # a constraint bound to no table
        return None
    table_name: str | None = getattr(table, "name", None)
    return table_name


def include_object(
    object: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Alembic ``include_object`` hook that leaves the outbox's tables alone.

    The outbox tables (``outbox_email``, ``outbox_attachment``, ``outbox_setting``) live
    on the library's own MetaData and are migrated by the ``outbox`` branch, so they are
    in the database but not in your ``target_metadata``. Without this hook,
    ``flask db migrate`` proposes to drop them. The hook excludes those tables and
    everything on them (columns, indexes, unique constraints, foreign keys), and includes
    everything else::

        from . import include_object

        context.configure(connection=connection, target_metadata=target_metadata,
                          include_object=include_object)

    A foreign key from one of your tables to ``outbox_email`` stays yours: it belongs to
    your table, and is compared as usual.
    """
    return _table_name_of(object, name, type_) not in TABLE_NAMES


def combine_include_object(user_hook: IncludeObject | None) -> IncludeObject:
    """An ``include_object`` hook that excludes the outbox tables, then asks ``user_hook``.

    For a project that already filters objects in autogenerate::

        from . import combine_include_object

        context.configure(connection=connection, target_metadata=target_metadata,
                          include_object=combine_include_object(my_include_object))

    With ``user_hook=None`` this is :func:`include_object` itself.
    """
    if user_hook is None:
        return include_object
    hook = user_hook

    def combined(
        object: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
    ) -> bool:
        return include_object(object, name, type_, reflected, compare_to) and hook(
            object, name, type_, reflected, compare_to
        )

    return combined
