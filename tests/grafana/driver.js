'use strict';
// Runs dashboard panels through Grafana's own code (@grafana/data).
//
// stdin: JSON [{panel, answers: [{query, data}], context}]: a panel of a dashboard, and
// for each of its targets the target (expr with variables filled in) with the
// Prometheus API's "data" for it; context (optional): the dashboard's time range
// and variables, {time: {from, to}, variables: {name: [values]}}, for its data
// links (tests/grafana/links.js). stdout: JSON [{title, frames, values}]: the
// frames after the panel's own transformations (each field's name, display
// name, type and values; for a table, each number cell as the table shows it:
// its display text after the panel's field config, units and value mappings,
// overrides matched by Grafana's own matchers; for a field with data links,
// each row's links as {title, href}) and, for a stat panel, the
// numbers it shows (each number field reduced with the panel's calcs). NaN and
// +-Inf are written as the strings "NaN", "+Inf", "-Inf".
//
// @grafana/data's ESM build does not load in Node: require the CommonJS one.
const data = require('@grafana/data');

// Outside Grafana there is no browser, and no transformer registered.
globalThis.window = globalThis.window ?? {};
if (!globalThis.navigator) {
  Object.defineProperty(globalThis, 'navigator', {
    value: { userAgent: 'node', language: 'en-US', languages: ['en-US'] }, configurable: true,
  });
}
// (seriesToColumns is joinByField under its old name: register each once;
// Grafana 13 loads a transformer lazily, so ``transformation`` is a loader.)
data.standardTransformersRegistry.setInit(() =>
  [...new Set(Object.values(data.standardTransformers))].map((t) => ({
    id: t.id, name: t.name, description: t.description, editor: null, transformation: async () => t,
  })));

const { panelFrames } = require('./frames');
const { rowLinks } = require('./links');

const theme = data.createTheme();

function plain(v) {
  if (typeof v === 'number' && !Number.isFinite(v)) return Number.isNaN(v) ? 'NaN' : v > 0 ? '+Inf' : '-Inf';
  return v === undefined ? null : v;
}

// The field's config as the panel gives it: its defaults (where the field has none), then each override whose
// matcher (Grafana's own, by id) takes the field. A property id with a dot
// (custom.cellOptions) goes into that object, as Grafana sets it.
function fieldConfig(panel, field, frame, frames) {
  const config = { ...(panel.fieldConfig?.defaults ?? {}), ...(field.config ?? {}) };
  for (const override of panel.fieldConfig?.overrides ?? []) {
    const matches = data.fieldMatchers.get(override.matcher.id).get(override.matcher.options);
    if (!matches(field, frame, frames)) continue;
    for (const { id, value } of override.properties) {
      const [head, ...rest] = id.split('.');
      if (rest.length === 0) config[head] = value;
      else config[head] = { ...(config[head] ?? {}), [rest.join('.')]: value };
    }
  }
  return config;
}

// Each value of a number field as the table cell shows it: Grafana's display processor
// (units, decimals, value mappings) on the field with the panel's config.
function shown(panel, field, frame, frames) {
  if (panel.type !== 'table' || field.type !== data.FieldType.number) return null;
  const display = data.getDisplayProcessor({
    field: { ...field, config: fieldConfig(panel, field, frame, frames) }, theme,
  });
  return Array.from(field.values, (v) => data.formattedValueToString(display(v)));
}

function dump(panel, frame, frames, context) {
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
      display: shown(panel, f, frame, frames),
      links: panel.type === 'table' ? rowLinks(frame, { ...f, config: fieldConfig(panel, f, frame, frames) }, context)
        : null,
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
  for (const { panel, answers, context } of jobs) {
    const frames = await transform(panel, panelFrames(answers));
    results.push({
      title: panel.title,
      frames: frames.map((frame) => dump(panel, frame, frames, context)),
      values: panel.type === 'stat' ? statValues(panel, frames) : null,
    });
  }
  process.stdout.write(JSON.stringify(results));
}

main().catch((err) => {
  process.stderr.write(`${err.stack ?? err}\n`);
  process.exit(1);
});
