/* attnres-probe dashboard: the two view changes that run in the browser.
 * pick_token: a token chip click (or a click on a one-source heatmap cell) -> the token store.
 * mark_chips: highlight the selected chip.
 * mark_source_token: a box round the selected token's column in the one-source heatmaps.
 * show_query: the view's state (token, colour, views, text) into the address bar, to share or bookmark.
 * Token text is never written as HTML here; Dash renders chip children as text. */
window.dash_clientside = Object.assign({}, window.dash_clientside, {
    attnres: {
        pick_token: function () {
            var nu = window.dash_clientside.no_update;
            var state = arguments[arguments.length - 1];
            var ctx = window.dash_clientside.callback_context;
            if (!state || !ctx || !ctx.triggered || ctx.triggered.length !== 1) { return nu; }
            var trig = ctx.triggered[0];
            if (!trig.value) { return nu; }  // chips re-rendered for a new text: no click yet
            var id = trig.prop_id, token;
            if (id.slice(-9) === ".n_clicks") {
                token = JSON.parse(id.slice(0, -9)).index;
            } else if (trig.value.points && trig.value.points.length) {
                token = trig.value.points[0].x;
                // a long trace's heatmap names its columns "12 'a'" (position, token)
                if (typeof token === "string") { token = parseInt(token, 10); if (isNaN(token)) { token = undefined; } }
            }
            if (typeof token !== "number" || token === state.token) { return nu; }
            return {key: state.key, token: token};
        },
        mark_chips: function (state, ids) {
            var sel = state ? state.token : -1;
            // the strip scrolls (not the page) so the selected chip is in view, after the classes are set
            window.setTimeout(function () {
                var strip = document.getElementById("token-strip");
                var chip = strip && strip.children[sel];
                if (!chip) { return; }
                var top = chip.offsetTop - strip.offsetTop, bottom = top + chip.offsetHeight;
                if (top < strip.scrollTop || bottom > strip.scrollTop + strip.clientHeight) {
                    strip.scrollTop = Math.max(0, top - (strip.clientHeight - chip.offsetHeight) / 2);
                }
            }, 0);
            return ids.map(function (id) { return id.index === sel ? "chip selected" : "chip"; });
        },
        // the selected token marked in every "one source at every token" heatmap: a thin box around its
        // column, drawn in the browser (the figures are not sent again for a token click)
        mark_source_token: function (state) {
            var graphs = document.querySelectorAll("[id^='source-graph-'] .js-plotly-plot");
            Array.prototype.forEach.call(graphs, function (gd) {
                if (!gd.layout || !window.Plotly) { return; }
                var keep = (gd.layout.shapes || []).filter(function (s) { return s.name !== "selected-token"; });
                if (state && typeof state.token === "number") {  // a category axis counts its columns, too
                    keep.push({type: "rect", name: "selected-token", xref: "x", yref: "paper", x0: state.token - 0.5,
                               x1: state.token + 0.5, y0: 0, y1: 1, line: {color: "#d62728", width: 2},
                               fillcolor: "rgba(0,0,0,0)", layer: "above"});
                }
                window.Plotly.relayout(gd, {shapes: keep});
            });
            return window.dash_clientside.no_update;
        },
        // the view's query string into the address bar, replacing the entry (no reload, no history step)
        show_query: function (query) {
            if (typeof query === "string" && window.location.search !== query) {
                window.history.replaceState(window.history.state, "", window.location.pathname + query);
            }
            return window.dash_clientside.no_update;
        }
    }
});
