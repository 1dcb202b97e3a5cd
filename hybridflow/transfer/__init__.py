"""Weight transport from trainer to rollout: buckets (``weights``) and the process-group sender and
receivers (``weight_transfer``). Both sides import it (``workers/weight_stream.py`` sends, the rollout
engines receive), so it sits below them both.
"""
