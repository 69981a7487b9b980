'use strict';
// A panel's data links as Grafana renders them for a row: @grafana/data's own
// getLinksSupplier (which assures the base URL, interpolates the URL with the
// "uriencode" format and sanitizes it), given the replaceVariables function a
// Grafana dashboard passes it. That function lives in Grafana's app (its
// dashboards are @grafana/scenes objects), not in an npm package we install,
// so this is our own, written from Grafana's documentation of data link
// variables and variable formats ("Configure data links", "Variable syntax")
// and following @grafana/scenes' interpolator, for the variables a link here
// uses:
//
// - ${__data.fields.<name>}: the row's value of that field, found as
//   @grafana/data's getFieldDisplayValuesProxy finds it (by name, index,
//   display name, "name" label) and written as its display text;
// - ${__value.raw}, ${__value.text}: the cell's own value;
// - ${__url_time_range}: the dashboard's time range as URL parameters
//   (from=now-6h&to=now), not formatted further;
// - ${name} and ${name:queryparam} of a dashboard variable: its values, or as
//   URL parameters (var-name=a&var-name=b; "All" is var-name=$__all);
// - formats: none given is "glob" ({a,b} for several values), "uriencode"
//   (what getLinksSupplier asks for a URL: encodeURI, and !'()* escaped),
//   "queryparam".
//
// Anything else is left as written, as Grafana leaves a variable it does not know.

const data = require('@grafana/data');
const property = require('lodash/property');

// Grafana's variable reference: $var, [[var:fmt]], ${var.path:fmt}.
const VARIABLE_REGEX = /\$(\w+)|\[\[(\w+?)(?::(\w+))?\]\]|\${(\w+)(?:\.([^:^}]+))?(?::([^}]+))?}/g;

const strict = (text) => text.replace(/[!'()*]/g, (c) => `%${c.charCodeAt(0).toString(16).toUpperCase()}`);

function format(value, fmt, name) {
  const values = Array.isArray(value) ? value : null;
  switch (fmt ?? 'glob') {
    case 'queryparam':
      return data.urlUtil.toUrlParams({ [`var-${name}`]: values ?? [value] });
    case 'uriencode':
      return strict(encodeURI(values ? `{${values.join(',')}}` : String(value)));
    case 'raw':
      return String(value);
    default: // glob
      return values && values.length > 1 ? `{${values.join(',')}}` : String(values ? values[0] : value);
  }
}

// replaceVariables(text, scopedVars, format) for a dashboard whose time range is ``time``
// ({from, to}, as in its URL) and whose variables are ``variables`` (name to values).
function interpolator({ time = {}, variables = {} } = {}) {
  return (text, scopedVars, defaultFormat) => String(text ?? '').replace(VARIABLE_REGEX,
    (match, var1, var2, fmt2, var3, fieldPath, fmt3) => {
      const name = var1 || var2 || var3;
      const fmt = fmt2 || fmt3 || defaultFormat;
      const context = scopedVars?.__dataContext?.value;
      if (name === '__url_time_range') return data.urlUtil.toUrlParams(time);
      if (name === '__data') {
        if (!context || context.rowIndex === undefined || !fieldPath) return match;
        const row = { name: context.frame.name, refId: context.frame.refId,
          fields: data.getFieldDisplayValuesProxy({ frame: context.frame, rowIndex: context.rowIndex }) };
        const value = property(fieldPath)(row);
        return format(value === undefined ? '' : `${value}`, fmt, name);
      }
      if (name === '__value') {
        if (!context || context.rowIndex === undefined || !context.field) return match;
        const raw = context.field.values[context.rowIndex];
        if (fieldPath === 'raw') return format(raw, fmt, name);
        const display = context.field.display ?? data.getDisplayProcessor({ field: context.field });
        return format(data.formattedValueToString(display(raw)), fmt, name);
      }
      if (Object.prototype.hasOwnProperty.call(variables, name)) return format(variables[name], fmt, name);
      return match;
    });
}

// Each row's links of ``field`` (its config already the panel's): [[{title, href}]] by row.
function rowLinks(frame, field, context) {
  if (!field.config.links?.length) return null;
  const supplier = data.getLinksSupplier(frame, field, {}, interpolator(context));
  return Array.from({ length: frame.length }, (_, row) =>
    supplier({ valueRowIndex: row }).map(({ title, href }) => ({ title, href })));
}

module.exports = { interpolator, rowLinks };
