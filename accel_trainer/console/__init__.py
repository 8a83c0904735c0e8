"""What the terminal shows of a command besides its output: accel-trainer's own warnings as one line, and a
closed stdout that ends a command quietly.

Entry points (cli.py and training.py install both): `warning_lines.show_our_warnings_as_one_line`,
`closed_stdout.exit_quietly_when_stdout_closes`.
"""
