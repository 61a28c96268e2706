"""Pictures of bench results (matplotlib, the optional `bench` extra): bars with
their min..max spread, and curves. Imported only when a bench is asked for --plot."""
