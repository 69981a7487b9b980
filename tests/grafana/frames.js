'use strict';
// Prometheus HTTP API answers as the data frames Grafana's Prometheus data
// source hands to a panel. Grafana makes them on its server (in Go); no npm
// package does that step, so this is our own, written from the Prometheus API
// documentation (https://prometheus.io/docs/prometheus/latest/querying/api/)
// and the frame layout Grafana documents for time series and tables:
//
// - format "time_series": one frame per series, a Time field (milliseconds)
//   and a number field named "Value" carrying the series' labels, __name__
//   included; the field's display name comes from the query's legend format.
// - format "table": per query (refId), one frame: Time, one string field per
//   label name found in any of its series (sorted by name, __name__ among
//   them; "" where a series lacks the label), and the number field "Value",
//   named "Value #<refId>" when the panel's answer holds several queries.
//
// Sample values are strings in the API; "NaN", "+Inf" and "-Inf" become
// NaN, Infinity and -Infinity, as Grafana's float64 values decode in the browser.

function sampleValue(text) {
  if (text === 'NaN') return NaN;
  if (text === '+Inf' || text === 'Inf') return Infinity;
  if (text === '-Inf') return -Infinity;
  const v = Number(text);
  if (Number.isNaN(v)) throw new Error(`not a Prometheus sample value: ${JSON.stringify(text)}`);
  return v;
}

// The series' name as a legend shows it: the legend format with each
// {{label}} replaced by that label's value ("" when absent); "__auto" or no
// format: the metric name and its other labels, as Prometheus prints a series.
function legendName(labels, legendFormat) {
  if (legendFormat && legendFormat !== '__auto') {
    return legendFormat.replace(/\{\{\s*(.+?)\s*\}\}/g, (_, name) => labels[name] ?? '');
  }
  const { __name__: name = '', ...rest } = labels;
  const inner = Object.keys(rest).sort().map((k) => `${k}="${rest[k]}"`).join(', ');
  if (!name && Object.keys(rest).length === 1) return Object.values(rest)[0];
  return inner ? `${name}{${inner}}` : name;
}

// Time series frames of one query's answer (the API's "data" object).
function seriesFrames(data, query) {
  const refId = query.refId;
  const frame = (labels, points) => ({
    refId,
    name: legendName(labels, query.legendFormat),
    length: points.length,
    fields: [
      { name: 'Time', type: 'time', config: {}, values: points.map(([t]) => Math.round(t * 1000)) },
      {
        name: 'Value', type: 'number', labels: { ...labels },
        config: { displayNameFromDS: legendName(labels, query.legendFormat) },
        values: points.map(([, v]) => sampleValue(v)),
      },
    ],
  });
  switch (data.resultType) {
    case 'vector':
      return data.result.map((s) => frame(s.metric, [s.value]));
    case 'matrix':
      return data.result.map((s) => frame(s.metric, s.values));
    case 'scalar':
      return [frame({}, [data.result])];
    default:
      throw new Error(`unexpected result type ${data.resultType}`);
  }
}

// The table frame of one query's series frames.
function tableFrame(frames, refId, valueName) {
  const names = [...new Set(frames.flatMap((f) => Object.keys(f.fields[1].labels)))].sort();
  const time = { name: 'Time', type: 'time', config: {}, values: [] };
  const labelFields = names.map((name) => ({ name, type: 'string', config: { filterable: true }, values: [] }));
  const value = { name: valueName, type: 'number', config: {}, values: [] };
  for (const f of frames) {
    const labels = f.fields[1].labels;
    f.fields[0].values.forEach((t, i) => {
      time.values.push(t);
      labelFields.forEach((field) => field.values.push(labels[field.name] ?? ''));
      value.values.push(f.fields[1].values[i]);
    });
  }
  return { refId, length: time.values.length, fields: [time, ...labelFields, value] };
}

// The frames a panel gets: ``answers`` is [{query, data}] for its targets.
function panelFrames(answers) {
  const series = answers.map(({ query, data }) => ({ query, frames: seriesFrames(data, query) }));
  const tables = series.filter(({ query }) => query.format === 'table');
  const several = tables.length > 1;
  return series.flatMap(({ query, frames }) => {
    if (query.format !== 'table') return frames;
    if (frames.length === 0) return [];
    return [tableFrame(frames, query.refId, several ? `Value #${query.refId}` : 'Value')];
  });
}

module.exports = { sampleValue, legendName, seriesFrames, tableFrame, panelFrames };
