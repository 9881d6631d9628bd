"""`runserver` (as `make dev` starts it) on Sigil's server, which reads chunked bodies."""

from django.contrib.staticfiles.management.commands.runserver import Command as StaticFilesRunserver

from sigil_site.devserver import ChunkedWSGIServer


class Command(StaticFilesRunserver):
    server_cls = ChunkedWSGIServer
