// wan-sage panel: debounce, change detection and latest-request-wins, with an injectable clock.
// Side-effect free (the frontend imports every .js under web/ as an extension).

/** The clock used when none is given: the global timers, looked up at call time. */
const globalClock = {
  setTimeout: (fn, ms) => globalThis.setTimeout(fn, ms),
  clearTimeout: (t) => globalThis.clearTimeout(t),
};

/**
 * ``fn`` runs ``wait`` ms after the last call, with that call's arguments.
 * The returned function has cancel(), flush() (run now if pending) and pending().
 */
export function debounce(fn, wait = 300, clock = globalClock) {
  let timer = null;
  let args = [];
  const run = () => {
    timer = null;
    const a = args;
    args = [];
    fn(...a);
  };
  const d = (...a) => {
    args = a;
    if (timer !== null) clock.clearTimeout(timer);
    timer = clock.setTimeout(run, wait);
  };
  d.cancel = () => {
    if (timer !== null) clock.clearTimeout(timer);
    timer = null;
    args = [];
  };
  d.flush = () => {
    if (timer === null) return;
    clock.clearTimeout(timer);
    run();
  };
  d.pending = () => timer !== null;
  return d;
}

/**
 * Watch a value that has no change event (widget values on this and upstream nodes).
 * check() reads it; when its JSON differs from the last read, onChange(value) is scheduled
 * ``wait`` ms later (each further change restarts the wait).  Returns true when it changed.
 * reset() forgets the last value, so the next check() counts as a change.
 */
export function changeWatcher({ read, onChange, wait = 300, clock = globalClock }) {
  let last;
  let seen = false;
  const fire = debounce((v) => onChange(v), wait, clock);
  return {
    check() {
      const v = read();
      const key = JSON.stringify(v) ?? "undefined";
      if (seen && key === last) return false;
      seen = true;
      last = key;
      fire(v);
      return true;
    },
    reset() {
      seen = false;
      last = undefined;
    },
    cancel: () => fire.cancel(),
    flush: () => fire.flush(),
    pending: () => fire.pending(),
  };
}

/** Latest request wins: const t = seq.next(); ...await...; if (!seq.isCurrent(t)) return; */
export function sequencer() {
  let n = 0;
  return { next: () => ++n, isCurrent: (t) => t === n };
}
