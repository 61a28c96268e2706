"""Router benches: routing policies across N real engines in virtual time, the SWA mis-routing
case, and a run on real gcache-worker / gcache-router processes."""
