"""Sessions, whichever transport carries them: the registry of live ids, the calls a session
carries, and an open session's life.
"""
