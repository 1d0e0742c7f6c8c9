"""`quire router`: the OpenAI API in front of prefill, decode and collocated instances
(app.py), and the policies that pick an instance (policies.py). It speaks HTTP only."""
