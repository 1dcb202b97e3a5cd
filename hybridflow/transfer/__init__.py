"""Weight transport from trainer to rollout: buckets (``weights``) and the process-group sender and
receivers (``weight_transfer``). Both sides import it (``workers/actor.py`` sends, the rollout
engines receive), so it sits below them both.
"""
