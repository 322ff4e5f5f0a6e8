"""`serve run deployments.app:app` starts the default config (embedded model pair, CPU, unified mode);
`serve run configs/<mode>.yaml` is the documented way to choose a mode and placement."""

from deployments.builder import build_app

app = build_app({})
