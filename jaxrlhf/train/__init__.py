"""Training: one jitted program per algorithm step, and the loop around it."""
