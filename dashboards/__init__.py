"""attnres_probe.dashboards (see DESIGN.md)."""
