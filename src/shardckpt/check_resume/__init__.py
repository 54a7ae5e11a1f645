"""``shardckpt check-resume`` and ``shardckpt diff``: proving that a script resumes exactly, and comparing steps.

* :mod:`.run`: the three runs of the command and the kills (the checker's side, torch-free);
* :mod:`.probe`: what a run under the check does (redirected paths, one record per ``save()`` call, the stop);
* :mod:`.compare`: comparing the records of two runs, and what a difference means (torch-free);
* :mod:`.digest`: the fingerprints of a training state, per key.

Importing the package imports none of them (the CLI stays torch-free).
"""
