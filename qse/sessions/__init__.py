"""Sessions on the grid, for any engine: the exact state of a session (grid.py, session.py) and the served
model's turns on top of it (served.py). The shadow reader (qse/shadow) is the other user."""
