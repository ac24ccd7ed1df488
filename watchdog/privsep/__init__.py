"""Privilege separation: code run as a job's owner, never as root (``readers``), over checked frames
(``frames``), with the requests registered from above (``registry``). Below ``observe`` and ``evidence``,
which register their own handlers; it imports neither (docs/privsep.md)."""
