"""Cost: device-seconds per stage, dollars per cycle and intelligence per dollar, with its plot."""
