"""Message building: ``Message``, its fields and addresses, the MIME it becomes, DKIM.

The bottom layer above the errors: it imports nothing else of the package and
knows no Flask. The settings a message is built with when none are passed
come from :mod:`.ambient`, where the Flask integration installs a provider.
"""
