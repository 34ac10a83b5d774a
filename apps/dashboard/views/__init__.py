"""People-facing views: each parses input, checks the role (apps.teams.access), calls one domain
function and renders a page or the region an HTMX request asked for."""
