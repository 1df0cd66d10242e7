"""The fleet the coordinator serves on: worker membership, discovery and health (``registry``), a fleet
planned, built and shipped from a source (``planned``), re-planning, preparing and ``--local-workers``."""
