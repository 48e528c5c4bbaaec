"""Model implementations written for paged attention, registered by architecture name."""
