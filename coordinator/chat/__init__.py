"""``fleet-chat``: the terminal chat client (``client``) and the status line it shows while it waits."""
