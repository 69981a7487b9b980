'use strict';
// Runs dashboard panels through Grafana's own code (@grafana/data).
//
// stdin: JSON [{panel, answers: [{query, data}]}]: a panel of a dashboard, and
// for each of its targets the target (expr with variables filled in) with the
// Prometheus API's "data" for it. stdout: JSON [{title, frames, values}]: the
// frames after the panel's own transformations (each field's name, display
// name, type and values) and, for a stat panel, the numbers it shows (each
// number field reduced with the panel's calcs). NaN and +-Inf are written as
// the strings "NaN", "+Inf", "-Inf".
//
// @grafana/data's ESM build does not load in Node: require the CommonJS one.
const data = require('@grafana/data');

// Outside Grafana there is no browser, and no transformer registered.
globalThis.window = globalThis.window ?? {};
if (!globalThis.navigator) {
  Object.defineProperty(globalThis, 'navigator', { value: { userAgent: 'node', language: 'en-US' }, configurable: true });
}
// (seriesToColumns is joinByField under its old name: register each once;
// Grafana 13 loads a transformer lazily, so ``transformation`` is a loader.)
data.standardTransformersRegistry.setInit(() =>
  [...new Set(Object.values(data.standardTransformers))].map((t) => ({
    id: t.id, name: t.name, description: t.description, editor: null, transformation: async () => t,
  })));

const { panelFrames } = require('./frames');

function plain(v) {
  if (typeof v === 'number' && !Number.isFinite(v)) return Number.isNaN(v) ? 'NaN' : v > 0 ? '+Inf' : '-Inf';
  return v === undefined ? null : v;
}

function dump(frame) {
  return {
    refId: frame.refId ?? null,
    name: frame.name ?? null,
    length: frame.length,
    fields: frame.fields.map((f) => ({
      name: f.name,
      displayName: data.getFieldDisplayName(f, frame),
      type: f.type,
      labels: f.labels ?? null,
      values: Array.from(f.values, plain),
    })),
  };
}

async function transform(panel, frames) {
  const transformations = panel.transformations ?? [];
  if (transformations.length === 0) return frames;
  return new Promise((resolve, reject) => {
    data.transformDataFrame(transformations, frames).subscribe({ next: resolve, error: reject });
  });
}

function statValues(panel, frames) {
  const calcs = panel.options?.reduceOptions?.calcs ?? ['lastNotNull'];
  const out = [];
  for (const frame of frames) {
    for (const field of frame.fields) {
      if (field.type !== data.FieldType.number) continue;
      const reduced = data.reduceField({ field, reducers: calcs });
      out.push({ displayName: data.getFieldDisplayName(field, frame), value: plain(reduced[calcs[0]]) });
    }
  }
  return out;
}

async function main() {
  const chunks = [];
  for await (const chunk of process.stdin) chunks.push(chunk);
  const jobs = JSON.parse(Buffer.concat(chunks).toString('utf8'));
  const results = [];
  for (const { panel, answers } of jobs) {
    const frames = await transform(panel, panelFrames(answers));
    results.push({
      title: panel.title,
      frames: frames.map(dump),
      values: panel.type === 'stat' ? statValues(panel, frames) : null,
    });
  }
  process.stdout.write(JSON.stringify(results));
}

main().catch((err) => {
  process.stderr.write(`${err.stack ?? err}\n`);
  process.exit(1);
});
