"""What the terminal shows of a command besides its output: accel-trainer's own warnings as one line
(`warning_lines.show_our_warnings_as_one_line`), and a closed stdout that ends a command quietly
(`closed_stdout.exit_quietly_when_stdout_closes`). cli.py and run.py install both.
"""
