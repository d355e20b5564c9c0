"""The launcher's router (`launch run … --serve`): the front ends live in the launcher and
replay in-flight requests on a restarted ring (router.py; docs/failures.md, "The router and replay")."""
