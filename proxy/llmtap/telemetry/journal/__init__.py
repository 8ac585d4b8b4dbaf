"""The record journal (``--record-journal``): every tape a telemetry process takes, kept on disk until every record
sink has its record, and played again after a restart.

Its own room: the intake writes to it (each tape as it arrives; the ends that never arrived counted by their
sequence numbers, ``sequences``) and the records acknowledge it (each sink's record settled), so it imports
neither. ``losses`` is here too: the loss totals it keeps across restarts live in the journal's slot.
"""
