"""The django-post-office peer: a minimal Django project written into the run's directory.

django-post-office is the Django world's database outbox: ``mail.send(...)``
stores an ``Email`` row and ``manage.py send_queued_mail --processes P`` sends
what is queued, batch by batch, until nothing is left. It needs Django, which
must not enter this project's environment, so it runs with the python of a
virtualenv of its own, named by ``BENCH_POST_OFFICE_PYTHON`` (the recipe is in
``benchmarks/peers/README.md``). The project: PostgreSQL (a database of the
benchmark's cluster), post-office's ``default`` backend Django's SMTP backend
on the sink, every other ``POST_OFFICE`` setting at its default. Standard
library only: this process never imports Django.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import unquote, urlsplit

_SETTINGS = '''import json
from pathlib import Path

_BENCH = json.loads((Path(__file__).parent / "bench.json").read_text())
SECRET_KEY = "benchmark-only"
DEBUG = False  # True would keep every query in memory
USE_TZ = True
INSTALLED_APPS = ["post_office"]
# mail.send() renders subject and body as Django templates, even without a template.
TEMPLATES = [{"BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True}]
DATABASES = {"default": _BENCH["database"]}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
EMAIL_BACKEND = "post_office.EmailBackend"
EMAIL_HOST = "127.0.0.1"
EMAIL_PORT = _BENCH["smtp_port"]
EMAIL_TIMEOUT = 30
POST_OFFICE = {"BACKENDS": {"default": "django.core.mail.backends.smtp.EmailBackend"}}
'''

_MANAGE = '''import os
import sys

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench_settings")
from django.core.management import execute_from_command_line

execute_from_command_line(sys.argv)
'''

# 500 per transaction, as the outbox's rows are queued.
_ENQUEUE = '''import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench_settings")
import django

django.setup()
from django.db import transaction
from post_office import mail

message = json.loads((Path(__file__).parent / "bench.json").read_text())["message"]
n = int(sys.argv[1])
for start in range(0, n, 500):
    with transaction.atomic():
        for i in range(start, min(n, start + 500)):
            mail.send(message["recipient"], message["sender"], subject=f"post-office #{i}",
                      message=message["body"], priority="medium")
'''


def write_project(directory: Path, *, database_url: str, smtp_port: int,
                  message: dict[str, str]) -> dict[str, str]:
    """The project in ``directory``; returns the environment its commands run with."""
    parts = urlsplit(database_url)
    database = {"ENGINE": "django.db.backends.postgresql", "NAME": parts.path.lstrip("/"),
                "USER": unquote(parts.username or ""), "PASSWORD": unquote(parts.password or ""),
                "HOST": parts.hostname or "", "PORT": str(parts.port or "")}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "bench.json").write_text(json.dumps(
        {"database": database, "smtp_port": smtp_port, "message": message}))
    (directory / "bench_settings.py").write_text(_SETTINGS)
    (directory / "manage.py").write_text(_MANAGE)
    (directory / "enqueue.py").write_text(_ENQUEUE)
    return {"PYTHONPATH": str(directory), "PYTHONNOUSERSITE": "1",
            "DJANGO_SETTINGS_MODULE": "bench_settings"}
