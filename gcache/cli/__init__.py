"""`gcache`: the operators' command line (main: put/get/exists/rm/stats/ping against a node;
admin: map/status/drain/remove against the masters)."""
