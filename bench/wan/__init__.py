"""The WAN: ``fleet-wan``'s links on one machine (``links``), the sweep of fleets behind them (``sweep``), the
discrete-event fleet model with its simulator and calibration, and a fleet that starts empty, timed."""
