#!/usr/bin/env python3
"""Reads a TensorBoard event file with the `tensorboard` package's own readers and prints what
they see, one line an event:

    file_version brain.Event:2
    scalar TAG STEP VALUE WALL_TIME        (VALUE as %.9g, WALL_TIME as %.17g)

    tests/tensorboard_read.py FILE

Exits 1 when a record's length or checksums are wrong (TensorBoard's record reader raises),
when the first event is not the file_version one, when an event is not one scalar, or when the
scalars that TensorBoard's EventAccumulator shows differ from the events in the file.
test_tensorboard --python (the CTest test_tensorboard_reader) writes a file with
src/io/tensorboard.c and compares these lines with what it wrote. It runs in the venv that
scripts/setup makes ($TANDEM_TEST_VENV), where `pip install tensorboard` put the package.
"""
import sys

from tensorboard.backend.event_processing import event_accumulator, event_file_loader
from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow


def fail(path, why):
    print(f"tensorboard_read: {path}: {why}", file=sys.stderr)
    sys.exit(1)


def count_records(path):
    """Reads every record with TensorBoard's record reader, which checks both checksums. The
    event loaders below stop quietly at a bad record (a file being written may end in half a
    record), so this is where a bad one is caught."""
    reader = pywrap_tensorflow.PyRecordReader_New(path.encode())
    n = 0
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return n
        except errors.DataLossError as e:
            fail(path, f"record {n}: {e.message}")
        n += 1


def main(path):
    sys.stdout.reconfigure(encoding="utf-8")  # tags are UTF-8 whatever the locale
    n = count_records(path)
    events = list(event_file_loader.LegacyEventFileLoader(path).Load())
    if len(events) != n or n == 0:
        fail(path, f"{n} records, {len(events)} events")
    if events[0].WhichOneof("what") != "file_version":
        fail(path, f"the first event holds {events[0].WhichOneof('what')}, not file_version")
    print("file_version", events[0].file_version)
    in_file = {}
    for i, e in enumerate(events[1:], 1):
        values = e.summary.value
        if e.WhichOneof("what") != "summary" or len(values) != 1:
            fail(path, f"event {i} is not one summary value")
        v = values[0]
        if v.WhichOneof("value") != "simple_value":
            fail(path, f"event {i} holds {v.WhichOneof('value')}, not simple_value")
        point = "%d %.9g %.17g" % (e.step, v.simple_value, e.wall_time)
        print("scalar", v.tag, point)
        in_file.setdefault(v.tag, []).append(point)
    # what TensorBoard's scalar charts are built from (strings, so that NaN equals NaN)
    acc = event_accumulator.EventAccumulator(path)
    acc.Reload()
    shown = {tag: ["%d %.9g %.17g" % (s.step, s.value, s.wall_time) for s in acc.Scalars(tag)]
             for tag in acc.Tags()["scalars"]}
    if shown != in_file:
        fail(path, f"EventAccumulator shows {shown}, the file holds {in_file}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
