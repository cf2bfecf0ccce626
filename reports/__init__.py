"""attnres_probe.reports (see DESIGN.md)."""
