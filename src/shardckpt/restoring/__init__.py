"""The restore path: finding the step to load (survey), its sources, the elastic plan, peeking at a step."""
