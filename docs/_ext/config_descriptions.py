"""Type and meaning of every configuration key, for docs/configuration.md.

Keys and defaults are not written here: ``python docs/_ext/outbox_config.py`` takes them from
``flask_mail_outbox.core._config._DEFAULTS`` and writes the table into the page; run it after
a change here or there. Every key there needs an entry here and every entry here a key there
(the build warns, and tests/test_docs.py fails, otherwise).
Each value is ``(type, meaning)`` in MyST Markdown, on one line.
"""

from __future__ import annotations

DESCRIPTIONS: dict[str, tuple[str, str]] = {
    "MAIL_SERVER": ("str", "the SMTP server's host name"),
    "MAIL_PORT": ("int", "the SMTP server's port (587 for STARTTLS, 465 for implicit TLS)"),
    "MAIL_USE_TLS": ("bool", "STARTTLS, required when on (it never falls back to plain text); "
                             "when off no STARTTLS is attempted even if the server offers it"),
    "MAIL_USE_SSL": ("bool", "implicit TLS; exclusive with `MAIL_USE_TLS`"),
    "MAIL_USERNAME": ("str or None", "SMTP login; the transport logs in after connecting "
                                     "when set"),
    "MAIL_PASSWORD": ("str or None", "SMTP password; never logged nor stored"),
    "MAIL_DEFAULT_SENDER": ("str, (name, address) or None",
                            "fills a missing `sender`: `\"a@x.org\"`, `\"Name <a@x.org>\"` or "
                            "`(\"Name\", \"a@x.org\")`"),
    "MAIL_ASCII_ATTACHMENTS": ("bool", "transliterate attachment file names to ASCII"),
    "MAIL_TIMEOUT": ("float (s)", "seconds per SMTP operation (Flask-Mailman's key)"),
    "OUTBOX_TRANSPORT": ("str", "`smtp`, `console`, `file`, `memory`, `null`, `mailbox`, or "
                                "`\"package.module:Class\"`: the default transport "
                                "([transports](guide/transports.md))"),
    "OUTBOX_TRANSPORTS": ("dict or None",
                          "named transports: `{name: {\"transport\": ..., \"MAIL_SERVER\": ..., "
                          "\"rate_limit\": \"14/s\", \"concurrency\": 8, \"failover\": [names]}}`; "
                          "the `MAIL_*` keys and `OUTBOX_TRANSPORT` are the implicit "
                          "`\"default\"` ([named transports](guide/transports.md#named-transports))"),
    "OUTBOX_FILE_PATH": ("str or None", "folder of the `file` transport; None: "
                                        "`<instance folder>/outbox-mail`"),
    "OUTBOX_DURABLE": ("bool", "the starting delivery mode; the shared runtime setting "
                               "(`flask outbox durable on|off`) overrides it"),
    "OUTBOX_MAX_ATTEMPTS": ("int", "attempts before a row is dead-lettered, both modes "
                                   "([the retry schedule](guide/modes.md#the-retry-schedule))"),
    "OUTBOX_INLINE_RETRIES": ("int", "inline mode: in-process retries of a transient failure "
                                     "before the schedule takes over"),
    "OUTBOX_RETRY_BASE_SECONDS": ("float (s)", "backoff: `base * 2**(attempts-1)`, ±20 % jitter"),
    "OUTBOX_RETRY_MAX_SECONDS": ("float (s)", "the cap of the backoff"),
    "OUTBOX_MAX_THROTTLE_DEFERRALS": ("int", "times a row's attempt is given back on a "
                                             "throttling reply; past it, throttling counts as a "
                                             "transient failure"),
    "OUTBOX_AMBIGUOUS_RETRIES": ("int", "retries of an attempt that may have been delivered "
                                        "(a drop after the final dot, a provider's timeout "
                                        "after the request went out, a 2xx it could not read); "
                                        "past it the row ends `failed`, its last error saying "
                                        "it may have been sent. Not used for a provider that "
                                        "honours an idempotency key (Resend)"),
    "OUTBOX_PAUSE_PROBE_SECONDS": ("float (s)", "a transport paused by a fault of its own "
                                                "(refused credentials, a spent quota, an "
                                                "unverified sender, unreachable) is probed "
                                                "this long after the fault, then at a "
                                                "doubling delay ([a paused transport]"
                                                "(guide/modes.md#a-paused-transport))"),
    "OUTBOX_PAUSE_PROBE_MAX_SECONDS": ("float (s)", "the longest delay between two probes of "
                                                    "a paused transport; at least "
                                                    "`OUTBOX_PAUSE_PROBE_SECONDS`"),
    "OUTBOX_MAX_QUEUE_LIFETIME_SECONDS": ("float (s) or None", "how long an email waits for "
                                                               "its paused transport before it "
                                                               "ends `failed`, the fault as its "
                                                               "last error (Postfix's "
                                                               "`maximal_queue_lifetime`, 5 "
                                                               "days); 0: at the first probe; "
                                                               "None: no bound"),
    "OUTBOX_LEASE_SECONDS": ("float (s)", "how long a claim holds a row; renewed every third "
                                          "of it while sending"),
    "OUTBOX_BATCH_SIZE": ("int", "rows per claim"),
    "OUTBOX_CONCURRENCY": ("int", "SMTP connections (sends in flight) per process per "
                                  "transport, 1 to 256; `flask outbox worker --concurrency N` "
                                  "overrides it for that worker"),
    "OUTBOX_POLL_INTERVAL": ("float (s)", "durable: the idle poll starts at this interval"),
    "OUTBOX_POLL_MAX_INTERVAL": ("float (s)", "durable: and doubles up to this one"),
    "OUTBOX_LISTEN": ("bool", "PostgreSQL: wake dispatchers with `LISTEN`/`NOTIFY` (turn off "
                              "behind PgBouncer in transaction mode)"),
    "OUTBOX_LISTEN_URL": ("str or None", "a direct database URL for the `LISTEN` connection"),
    "OUTBOX_LISTEN_BACKSTOP_SECONDS": ("float (s)", "the longest poll gap while `LISTEN` is up"),
    "OUTBOX_RUN_WORKER": ("bool", "durable mode: a serving app process runs a dispatcher too"),
    "OUTBOX_RATE_LIMIT": ("float (msg/s) or None",
                          "the default transport's `rate_limit`, shared by every process on the "
                          "database (before named transports it was per process); None: no limit"),
    "OUTBOX_SWEEP_ON_STARTUP": ("bool", "one sweep when a serving process starts"),
    "OUTBOX_SWEEP_MIN_AGE_SECONDS": ("float (s)", "the sweep takes due queued rows older than "
                                                  "this (younger ones may be in flight elsewhere)"),
    "OUTBOX_SWEEP_BATCH": ("int", "rows per sweep"),
    "OUTBOX_SWEEP_INTERVAL_SECONDS": ("float (s) or None", "the periodic sweep; None: 60 s in "
                                                           "inline mode, none in durable mode"),
    "OUTBOX_SETTINGS_TTL_SECONDS": ("float (s)", "how long a process caches the shared mode "
                                                 "setting"),
    "OUTBOX_MAX_MESSAGE_BYTES": ("int (bytes)", "the largest built message `send()` accepts"),
    "OUTBOX_ALLOW_LOCAL_ADDRESSES": ("bool", "accept `localhost`, single-label and special-use "
                                             "domains (`.test`, ...)"),
    "OUTBOX_MESSAGE_ID_DOMAIN": ("str or None", "the right-hand side of generated Message-IDs; "
                                                "None: the sender's domain (never a DNS lookup)"),
    "OUTBOX_HTML_TO_TEXT": ("bool", "an html message without `body` gets a text/plain "
                                    "rendering of the html (off: Flask-Mail's empty text part)"),
    "OUTBOX_TEMPLATE_FOLDER": ("str", "the folder of email templates in the app's Jinja loader "
                                      "([Templates](guide/templates.md))"),
    "OUTBOX_TEMPLATE_INLINE_CSS": ("bool", "inline a templated email's `<style>` blocks and "
                                           "static stylesheets with css-inline (the `templates` "
                                           "extra)"),
    "OUTBOX_TEMPLATE_LOCALES": ("list of str or None", "the locales emails are written in "
                                                       "(None: Flask-Babel's catalogs)"),
    "OUTBOX_TEMPLATE_MAX_SUBJECT": ("int", "the longest subject `flask outbox templates check` "
                                           "lets through, in characters"),
    "OUTBOX_ALLOW_SMTPUTF8": ("bool", "accept non-ASCII local parts, sent with SMTPUTF8 "
                                      "([SMTPUTF8](guide/messages.md#internationalised-addresses-smtputf8))"),
    "OUTBOX_DKIM_DOMAIN": ("str or None", "DKIM signing's `d=` ([DKIM](guide/messages.md#dkim-signing))"),
    "OUTBOX_DKIM_SELECTOR": ("str or None", "DKIM signing's `s=`"),
    "OUTBOX_DKIM_PRIVATE_KEY": ("str or None", "the RSA or Ed25519 private key as PEM text "
                                               "(or the next key)"),
    "OUTBOX_DKIM_PRIVATE_KEY_FILE": ("str or None", "the RSA or Ed25519 private key as a PEM file"),
    "OUTBOX_DKIM_KEYS": ("list of dict or None",
                         "instead of the selector and key: several keys of the domain, each "
                         "signing (RSA + Ed25519): `[{\"selector\": ..., \"private_key\": ... "
                         "or \"private_key_file\": ...}]` "
                         "([two keys](guide/messages.md#two-keys-rsa-and-ed25519-signatures))"),
    "OUTBOX_DKIM_HEADERS": ("list of str or None",
                            "headers signed when present (From always); None: From, To, Cc, "
                            "Subject, Date, Message-ID, Reply-To, MIME-Version, Content-Type, "
                            "List-Unsubscribe, List-Unsubscribe-Post"),
    "OUTBOX_TLS_VERIFY": ("bool", "verify the SMTP server's certificate (off: test servers only)"),
    "OUTBOX_TLS_CA_FILE": ("str or None", "a PEM bundle of a private CA"),
    "OUTBOX_RETENTION_DAYS": ("float (days) or None", "when set, the periodic job deletes "
                                                      "`sent`, `suppressed`, `expired` and "
                                                      "`cancelled` rows that ended longer "
                                                      "ago than this"),
    "OUTBOX_SCRUB_SENT": ("bool", "drop the bodies and attachments of a row once it is "
                                  "`sent`, `suppressed`, `expired` or `cancelled` (the "
                                  "dashboard shows them as scrubbed)"),
    "OUTBOX_HEALTH_MAX_QUEUED_AGE_SECONDS": ("float (s)", "`health()` reports `queue_too_old` "
                                                          "when an email has been due longer"),
    "OUTBOX_SOFT_BOUNCE_LIMIT": ("int", "soft bounces of one address within "
                                        "`OUTBOX_SOFT_BOUNCE_WINDOW_DAYS` that suppress it for "
                                        "`OUTBOX_SOFT_BOUNCE_SUPPRESS_DAYS`; 0: soft bounces never "
                                        "suppress ([soft bounces](events.md#soft-bounces))"),
    "OUTBOX_SOFT_BOUNCE_WINDOW_DAYS": ("float (days)", "how far back soft bounces are counted "
                                                      "(at most 3650); 0: soft bounces never "
                                                      "suppress"),
    "OUTBOX_SOFT_BOUNCE_SUPPRESS_DAYS": ("float (days)", "how long repeated soft bounces "
                                                        "suppress an address, from when the last one "
                                                        "is recorded (at most 3650); 0: they "
                                                        "never do"),
    "OUTBOX_WEBHOOK_PREFIX": ("str", "where provider webhooks are received: `POST "
                                     "<prefix>/<transport name>` for each `OUTBOX_TRANSPORTS` "
                                     "entry with a `webhook_secret` "
                                     "([events and suppression](events.md))"),
    "OUTBOX_UNSUBSCRIBE_URL": ("str or None", "an absolute https URL: "
                                              "`Message(list_unsubscribe=True)` links to it "
                                              "plus an opaque token encrypted with a key from "
                                              "`SECRET_KEY`, and its "
                                              "path takes the one-click POST "
                                              "([one-click unsubscribe](events.md#one-click-"
                                              "unsubscribe))"),
    "OUTBOX_BOUNCE_ADDRESS": ("str or None", "VERP: each SMTP delivery's envelope sender "
                                            "(MAIL FROM, hence Return-Path) becomes "
                                            "`local+<token>@domain`, the token naming the "
                                            "email, signed with `SECRET_KEY`; the header "
                                            "From is unchanged, API transports are "
                                            "unaffected ([bounces](bounces.md))"),
    "OUTBOX_REDIRECT_TO": ("list of str or None", "staging: every email goes to these bare "
                                                  "addresses instead of its recipients, the "
                                                  "original To and Cc kept in "
                                                  "`X-Outbox-Original-To`/`-Cc`; the row keeps "
                                                  "its real recipients "
                                                  "([staging](guide/staging.md))"),
    "OUTBOX_ALLOWED_RECIPIENTS": ("list of str or None", "staging: the only recipients mail "
                                                         "goes to, `user@example.com` or "
                                                         "`*@example.com`; an email with none "
                                                         "ends `cancelled` unsent "
                                                         "([staging](guide/staging.md))"),
    "OUTBOX_OTEL": ("dict or None", "OpenTelemetry tracing and metrics: `enabled` (True, "
                                    "False or `\"auto\"`: on when a tracer provider is set), "
                                    "`link` (`\"link\"` or `\"child\"`), `recipient_domain` "
                                    "(False), `metrics` (True, False or `\"auto\"`: on when a "
                                    "meter provider is set at `init_app`) "
                                    "([tracing](tracing.md))"),
    "OUTBOX_EXECUTOR": ("str", "what delivers committed emails: `\"dispatcher\"` (this "
                               "library's worker) or the workers of a task queue: "
                               "`\"celery\"`, `\"rq\"`, `\"dramatiq\"` (each its extra; "
                               "[executors](executors/index.md))"),
    "OUTBOX_EXECUTOR_QUEUE": ("str", "the task queue's queue the delivery and sweep tasks go "
                                     "to (its workers must listen on it)"),
    "OUTBOX_EXECUTOR_URL": ("str or None", "the broker URL for engines with no app of their "
                                           "own to name it (RQ's and Dramatiq's Redis, "
                                           "`redis://host:6379/0`); Celery uses its app's"),
    "OUTBOX_RUN_SCHEDULER": ("bool", "run the sweep jobs in serving processes (False: a "
                                     "script or a test that imports the app)"),
}
